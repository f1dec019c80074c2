"""The canary's PHP (``PhorgeBridgeCanary.php``) against its Python twin
(``bridge/canary/weights.py``, read through ``bridge/canary/store.py``), without Phorge.

The bucket, the two options' parsers and the side chosen are pure PHP: one plain
``php`` process (tests/helpers/canary_parity.php, with shims for the three libphutil
functions they call) answers the whole table below, and every answer must be Python's.
Each case is the two config rows' raw JSON, read as each side reads them from the config
table; a refusal is compared by its message with the described value left out (PHP
describes values as JSON, Python with ``repr``). The real-Phorge tier's
``test_queue_daemon.py`` does the same inside Phorge, with the SQL the daemon leases by.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from canary import EVERY_FEATURE

from bridge.canary.store import CanaryView, decode_state, decode_weights, php_json, read_json
from bridge.canary.weights import OPTION, STATE_OPTION, Canary, CanaryState, bucket, parse_weights
from bridge.phorge.extension import CANARY_FILENAME, shipped_file
from bridge.queue.implementations import CELERY, LEVELS

CANARY_PHP = shipped_file(CANARY_FILENAME)
DRIVER = Path(__file__).parents[1] / "helpers" / "canary_parity.php"

BUCKET_IDS = [*range(1, 10_001), 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1]
IDS = [*range(1, 301), 4_294_967_296, 9_007_199_254_740_993]
FAILURES = [None, 0, 1_700_000_000]  # failureTime: unset, then set (0 is set too)
CLASSES = ["A", "B", "C", "D", "E", "F", "G", "H", "X", "Unnamed", ""]

Answers = tuple[list[dict[str, Any]], dict[str, Any]]  # the cases sent, PHP's answers


@dataclass(frozen=True)
class Raw:
    """A config row's text as it is, not JSON of a value (bad JSON, an empty row)."""

    text: str


EVENT = {"at": 1, "class": "G", "level": "celery", "event": "rollback", "weight": 0}


def rolled(at: Any = 1_700_000_000, **entry: Any) -> dict[str, Any]:
    return {"rolled_back": {"at": at, "reason": "guard"}, **entry}


def state_of(classes: Any) -> dict[str, Any]:
    return {"classes": classes, "history": []}


def nested(depth: int) -> str:
    """A state row whose arrays nest ``depth`` deep (PHP's json_decode() stops at 512)."""
    return '{"deep": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


RAMP_A = {"A": {"ramp": {"level": "celery", "steps": [5, 10, 50]}}}


# (name, phorge-bridge.canary, phorge-bridge.canary-state): a value is written as JSON,
# a Raw as it is, None is no row.
CASES: list[tuple[str, Any, Any]] = [
    # -- accepted ------------------------------------------------------------------------
    ("no rows", None, None),
    ("rows of null", Raw("null"), Raw("null")),
    ("PHP's empty option", [], []),
    ("empty objects", {}, {}),
    (
        "every feature",
        EVERY_FEATURE,
        {
            "classes": {
                "D": {"celery": {"step": 2, "step_since": 1_700_000_000}},
                "G": {"celery": rolled()},
                "H": {"celery": rolled(1_700_000_001)},
                "B": {"python": rolled(1_700_000_002)},
            },
            "history": [EVENT],
        },
    ),
    (
        "a ramp past its end, rollbacks without a time",
        {"A": {"celery": 50}, "D": {"ramp": {"level": "celery", "steps": [10, 30]}}},
        state_of(
            {
                "D": {"celery": {"step": 7, "rolled_back": None}},
                "A": {"celery": {"rolled_back": {"at": None}}},
                "X": {"celery": {"rolled_back": {"at": 5}}},
            }
        ),
    ),
    ("a native default", {"*": {"celery": 100, "python": 0}, "B": {"celery": 30}}, None),
    ("a ramp at the python level", {"C": {"ramp": {"level": "python", "steps": [5, 50]}}}, None),
    ("a class with no weights", {"X": {}}, None),
    ("a class with no weights, as PHP stores it", {"X": []}, None),
    ("a class with no weights beside a default", {"*": {"celery": 0}, "X": {}}, None),
    ("a default with no weights", {"*": {}, "A": []}, None),
    ("a default of both levels at 0", {"*": {"celery": 0, "python": 0}}, None),
    (
        "a class's own guard bounds",
        {
            "A": {
                "celery": 5,
                "guard": {
                    "min_runs": 20,
                    "min_failures": 1,
                    "failure_limit": 5,
                    "max_drop": 0,
                    "significance": 0.001,
                    "max_slowdown": 1,
                    "slowdown_floor": 0.25,
                    "max_yielding": 86400,
                },
            },
            "B": {"python": 50, "guard": {"max_drop": 1, "max_slowdown": 100000000000000000000}},
            "C": {"guard": []},
        },
        None,
    ),
    (
        "a paused ramp",
        {"D": {"ramp": {"level": "celery", "steps": [5, 50]}}},
        state_of({"D": {"celery": {"step": 1, "step_since": 1, "paused": True}}}),
    ),
    (
        "a level at 0 beside a ramp",
        {"A": {"python": 0, "ramp": {"level": "celery", "steps": [5]}}},
        None,
    ),
    ("a class named at the python level only", {"*": {"celery": 0}, "C": {"python": 50}}, None),
    (
        "levels left out after the default",
        {"A": {"python": 20}, "*": {"celery": 0, "python": 0}, "B": {"celery": 30}},
        None,
    ),
    (
        "a ramp beside a default of 0",
        {"*": {"celery": 0}, "D": {"ramp": {"level": "celery", "steps": [5, 50]}, "python": 0}},
        state_of({"D": {"celery": {"step": 1}}}),
    ),
    ("an explicit 100 and 0", {"A": {"celery": 100.0, "python": 100}, "B": {"celery": 0.0}}, None),
    ("rounding: half to even", {"A": {"celery": 0.005}, "B": {"python": 0.015}}, None),
    ("rounding: thirds", {"A": {"celery": 33.333333}, "B": {"celery": 66.666667}}, None),
    ("rounding: next to 100", {"A": {"celery": 99.995}, "B": {"celery": 99.99999}}, None),
    ("rounding: tiny", {"A": {"celery": 1e-9}, "B": {"celery": 0.0001}}, None),
    ("a ramp of tiny steps", {"A": {"ramp": {"level": "celery", "steps": [0.004, 0.01]}}}, None),
    ("a class named empty", {"": {"celery": 40}}, state_of({"": {"celery": rolled()}})),
    ("a duplicate key: the last wins", Raw('{"A": {"celery": 5}, "A": {"celery": 60}}'), None),
    ("the state's odd but readable fields", None, {"classes": {"A": {"web": {"step": 3}}}}),
    (
        "rollbacks of every kind",
        {"A": {"celery": 40}, "B": {"python": 40}, "C": {"celery": 40}},
        state_of(
            {
                "A": {"celery": {"rolled_back": {}}, "python": {"rolled_back": []}},
                "B": {"python": {"rolled_back": {"at": 0}}},
                "C": {"celery": {"rolled_back": {"at": False}}},
                "X": {"python": rolled()},
            }
        ),
    ),
    (
        "ramp steps the bridge wrote",
        {c: {"ramp": {"level": "celery", "steps": [10, 20, 30]}} for c in "ABCDE"},
        state_of(
            {
                "A": {"celery": {"step": 0}},
                "B": {"celery": {"step": 1, "step_since": None}},
                "C": {"celery": {"step": 2}},
                "D": {"celery": {"step": 9_223_372_036_854_775_807}},
                "E": {"celery": {}},
            }
        ),
    ),
    (
        "PHP's empty objects in the state",
        None,
        {"classes": {"A": [], "B": {"celery": []}}, "history": {}},
    ),
    ("history with extra fields", None, {"history": [{**EVENT, "reason": "x", "more": [1]}]}),
    ("history of null fields", None, {"history": [dict.fromkeys(EVENT)]}),
    ("the state's other keys", None, {"classes": {}, "version": 2, "note": None}),
    ("a state nested 511 deep", None, Raw(nested(511))),
    ("a surrogate pair", {"\U0001f600": {"celery": 5}}, Raw('{"note": "\\ud83d\\ude00"}')),
    (
        "steps as PHP reads an object keyed 0, 1",
        Raw('{"A": {"ramp": {"level": "celery", "steps": {"0": 5, "1": 10}}}}'),
        None,
    ),
    (
        "history as PHP reads an object keyed 0",
        None,
        Raw('{"history": {"0": ' + json.dumps(EVENT) + "}}"),
    ),
    # -- the weights refused -------------------------------------------------------------
    ("not JSON", Raw("{not json"), None),
    ("an empty row", Raw(""), None),
    ("NaN", Raw('{"A": {"celery": NaN}}'), None),
    ("Infinity", Raw('{"A": {"celery": Infinity}}'), None),
    ("an overflowing float", Raw('{"A": {"celery": 1e999}}'), None),
    ("a number", 5, None),
    ("a string", "A", None),
    ("an empty string", "", None),
    ("true", True, None),
    ("false", False, None),
    ("zero", 0, None),
    ("a list", [1, 2], None),
    ("a list of weights", [{"celery": 5}], None),
    ("a class of null", {"A": None}, None),
    ("a class of a number", {"A": 5}, None),
    ("a class of a string", {"A": "bridge"}, None),
    ("a class of a list", {"A": [5]}, None),
    ("a class keyed by a number", {"A": {"0": 5}}, None),
    ("a percentage as a string", {"A": {"celery": "5"}}, None),
    ("a percentage with a sign", {"A": {"python": "50%"}}, None),
    ("a percentage of null", {"A": {"celery": None}}, None),
    ("a percentage of true", {"A": {"celery": True}}, None),
    ("a percentage of false", {"A": {"python": False}}, None),
    ("a percentage of an object", {"A": {"celery": {"value": 5}}}, None),
    ("a percentage of a list", {"A": {"celery": [5]}}, None),
    ("over 100", {"A": {"celery": 101}}, None),
    ("just over 100", {"A": {"celery": 100.0001}}, None),
    ("a huge integer", Raw('{"A": {"celery": 100000000000000000000}}'), None),
    ("a huge float", {"A": {"celery": 1e20}}, None),
    ("negative", {"A": {"celery": -1}}, None),
    ("negative, a fraction", {"A": {"python": -0.5}}, None),
    ("an unknown level", {"A": {"web": 5}}, None),
    ("a level in capitals", {"A": {"Bridge": 5}}, None),
    ("two levels partial", {"A": {"celery": 50, "python": 20}}, None),
    (
        "a shared level beside a ramp",
        {"A": {"python": 20, "ramp": {"level": "celery", "steps": [5]}}},
        None,
    ),
    (
        "a ramp and its level's weight",
        {"A": {"celery": 5, "ramp": {"level": "celery", "steps": [5]}}},
        None,
    ),
    ("a ramp of null", {"A": {"ramp": None}}, None),
    ("a ramp of a list", {"A": {"ramp": [1, 5]}}, None),
    ("an empty ramp", {"A": {"ramp": {}}}, None),
    ("an empty ramp, as PHP stores it", {"A": {"ramp": []}}, None),
    ("a ramp's unknown key", {"A": {"ramp": {"level": "celery", "steps": [5], "speed": 2}}}, None),
    ("a ramp without a level", {"A": {"ramp": {"steps": [5]}}}, None),
    ("a ramp's unknown level", {"A": {"ramp": {"level": "web", "steps": [5]}}}, None),
    ("a ramp's level of null", {"A": {"ramp": {"level": None, "steps": [5]}}}, None),
    ("a ramp's level in a list", {"A": {"ramp": {"level": ["celery"], "steps": [5]}}}, None),
    ("a ramp without steps", {"A": {"ramp": {"level": "celery"}}}, None),
    ("a ramp of no steps", {"A": {"ramp": {"level": "celery", "steps": []}}}, None),
    ("a ramp's steps of a number", {"A": {"ramp": {"level": "celery", "steps": 5}}}, None),
    ("a ramp's steps keyed", {"A": {"ramp": {"level": "celery", "steps": {"a": 5}}}}, None),
    ("a ramp's step as a string", {"A": {"ramp": {"level": "celery", "steps": ["5"]}}}, None),
    ("a ramp's step of 0", {"A": {"ramp": {"level": "celery", "steps": [0, 5]}}}, None),
    ("a ramp's step over 100", {"A": {"ramp": {"level": "python", "steps": [5, 101]}}}, None),
    ("a ramp's steps falling", {"A": {"ramp": {"level": "celery", "steps": [10, 5]}}}, None),
    ("a ramp's steps repeated", {"A": {"ramp": {"level": "celery", "steps": [5, 5]}}}, None),
    (
        "a ramp's steps equal once rounded",
        {"A": {"ramp": {"level": "celery", "steps": [5, 5.00001]}}},
        None,
    ),
    ("a dwell of 0", {"A": {"ramp": {"level": "celery", "steps": [5], "dwell": 0}}}, None),
    ("a negative dwell", {"A": {"ramp": {"level": "celery", "steps": [5], "dwell": -60}}}, None),
    (
        "a dwell as a float",
        {"A": {"ramp": {"level": "celery", "steps": [5], "dwell": 600.0}}},
        None,
    ),
    (
        "a dwell as a string",
        {"A": {"ramp": {"level": "celery", "steps": [5], "dwell": "600"}}},
        None,
    ),
    ("a dwell of true", {"A": {"ramp": {"level": "celery", "steps": [5], "dwell": True}}}, None),
    ("a dwell of null", {"A": {"ramp": {"level": "celery", "steps": [5], "dwell": None}}}, None),
    (
        "a huge dwell",
        Raw('{"A": {"ramp": {"level": "celery", "steps": [5], "dwell": 100000000000000000000}}}'),
        None,
    ),
    ("a default of 50", {"*": {"celery": 50}}, None),
    ("a default with guard bounds", {"*": {"celery": 0, "guard": {}}}, None),
    ("guard bounds of a list", {"A": {"guard": [1]}}, None),
    ("guard bounds of a string", {"A": {"guard": "strict"}}, None),
    ("an unknown guard bound", {"A": {"guard": {"max_drop": 0.1, "window": 60}}}, None),
    ("a guard's min_runs of a fraction", {"A": {"guard": {"min_runs": 1.5}}}, None),
    ("a guard's min_runs of 0", {"A": {"guard": {"min_runs": 0}}}, None),
    ("a guard's failure_limit of true", {"A": {"guard": {"failure_limit": True}}}, None),
    ("a guard's huge min_failures", {"A": {"guard": {"min_failures": 2**70}}}, None),
    ("a guard's max_drop above 1", {"A": {"guard": {"max_drop": 1.5}}}, None),
    ("a guard's significance of 1", {"A": {"guard": {"significance": 1}}}, None),
    ("a guard's significance of a string", {"A": {"guard": {"significance": "1e-6"}}}, None),
    ("a guard's max_slowdown below 1", {"A": {"guard": {"max_slowdown": 0.5}}}, None),
    ("a guard's slowdown_floor of 0", {"A": {"guard": {"slowdown_floor": 0}}}, None),
    ("a guard's max_yielding of a fraction", {"A": {"guard": {"max_yielding": 1.5}}}, None),
    ("a guard's max_yielding of 0", {"A": {"guard": {"max_yielding": 0}}}, None),
    ("a guard's bound of null", {"A": {"guard": {"max_drop": None}}}, None),
    ("a default of a fraction", {"*": {"python": 0.5}}, None),
    ("a default with a ramp", {"*": {"ramp": {"level": "celery", "steps": [5]}}}, None),
    (
        "a bad default after a bad class: the default's refusal",
        {"A": {"celery": 200}, "*": {"celery": 50}},
        None,
    ),
    ("a default of a number", {"*": 0}, None),
    ("a default of null", {"*": None}, None),
    ("a default of a string", {"*": "bridge"}, None),
    ("a default's unknown level", {"*": {"phd": 100}}, None),
    ("garbage deep in a class", {"A": {"celery": {"celery": {"celery": [[{}]]}}}}, None),
    ("classes keyed 0, 1: a list to PHP", {"0": {"celery": 5}, "1": {"celery": 6}}, None),
    ("weights nested 512 deep", Raw('{"A": ' + "[" * 511 + "]" * 511 + "}"), None),
    ("weights nested past Python's recursion", Raw('{"A": ' + "[" * 5000 + "]" * 5000 + "}"), None),
    ("a lone surrogate", Raw('{"\\ud800": {"celery": 5}}'), None),
    ("one bad class among good ones", {"A": {"celery": 5}, "B": {"python": 200}}, None),
    # -- the state refused ---------------------------------------------------------------
    ("a state not JSON", None, Raw("{classes")),
    ("an empty state row", None, Raw("")),
    ("a state with NaN", None, Raw('{"classes": {"A": {"celery": {"rolled_back": {"at": NaN}}}}}')),
    ("a state of a number", None, 5),
    ("a state of a string", None, "x"),
    ("a state of an empty string", None, ""),
    ("a state of true", None, True),
    ("a state of false", None, False),
    ("a state of a list", None, [1]),
    ("classes of null", None, {"classes": None}),
    ("classes of false", None, {"classes": False}),
    ("classes of a string", None, {"classes": "A"}),
    ("classes of an empty string", None, {"classes": ""}),
    ("classes of a list", None, {"classes": [1]}),
    ("a state's class of null", None, state_of({"A": None})),
    ("a state's class of zero", None, state_of({"A": 0})),
    ("a state's class of a number", None, state_of({"A": 5})),
    ("a state's class of a list", None, state_of({"A": [1]})),
    ("a level of null", None, state_of({"A": {"celery": None}})),
    ("a level of a number", None, state_of({"A": {"celery": 5}})),
    ("a level of a list", None, state_of({"A": {"celery": [1]}})),
    ("a step of null", RAMP_A, state_of({"A": {"celery": {"step": None}}})),
    ("a step as a word", RAMP_A, state_of({"A": {"celery": {"step": "x"}}})),
    ("a step as a number in a string", RAMP_A, state_of({"A": {"celery": {"step": "2"}}})),
    ("a step as a padded string", RAMP_A, state_of({"A": {"celery": {"step": " 1 "}}})),
    ("a step as a decimal string", RAMP_A, state_of({"A": {"celery": {"step": "1.5"}}})),
    ("a step with underscores", RAMP_A, state_of({"A": {"celery": {"step": "1_0"}}})),
    ("a step as a float", RAMP_A, state_of({"A": {"celery": {"step": 1.9}}})),
    ("a step as a whole float", RAMP_A, state_of({"A": {"celery": {"step": 1.0}}})),
    ("a step of true", RAMP_A, state_of({"A": {"celery": {"step": True}}})),
    ("a negative step", RAMP_A, state_of({"A": {"celery": {"step": -1}}})),
    ("a huge float step", RAMP_A, state_of({"A": {"celery": {"step": 1e300}}})),
    (
        "a step past PHP's integers",
        RAMP_A,
        Raw('{"classes": {"A": {"celery": {"step": 100000000000000000000}}}}'),
    ),
    ("a step of a list", RAMP_A, state_of({"A": {"celery": {"step": [1]}}})),
    ("a step of an object", RAMP_A, state_of({"A": {"celery": {"step": {"n": 1}}}})),
    ("a rollback of true", None, state_of({"A": {"celery": {"rolled_back": True}}})),
    ("a rollback of a number", None, state_of({"A": {"celery": {"rolled_back": 1_700_000_000}}})),
    ("a rollback of a string", None, state_of({"A": {"celery": {"rolled_back": "guard"}}})),
    ("a rollback of a list", None, state_of({"A": {"celery": {"rolled_back": [1_700_000_000]}}})),
    ("a rollback of false", None, state_of({"A": {"celery": {"rolled_back": False}}})),
    ("a rollback of zero", None, state_of({"A": {"celery": {"rolled_back": 0}}})),
    ("a rollback of an empty string", None, state_of({"A": {"celery": {"rolled_back": ""}}})),
    ("a rollback of the string 0", None, state_of({"A": {"celery": {"rolled_back": "0"}}})),
    ("a level keyed 0: a list to PHP", None, state_of({"A": {"0": {"step": 1}}})),
    ("a class keyed 0: a list to PHP", None, state_of({"0": {"celery": rolled()}})),
    ("a state nested 512 deep", None, Raw(nested(512))),
    (
        "a lone surrogate in the state",
        None,
        Raw('{"classes": {"A": {"celery": {"rolled_back": {"at": 1, "reason": "\\udc00"}}}}}'),
    ),
    ("history of null", None, {"history": None}),
    ("history of a string", None, {"history": "rollback"}),
    ("history of an empty string", None, {"history": ""}),
    ("history of an object", None, {"history": {"a": EVENT}}),
    ("history of a number", None, {"history": [1]}),
    ("history of a list", None, {"history": [[]]}),
    ("history of an event without its fields", None, {"history": [{"at": 1}]}),
    (
        "history of an event without its weight",
        None,
        {"history": [{k: v for k, v in EVENT.items() if k != "weight"}]},
    ),
    ("both refused", {"A": {"celery": 250}}, {"history": [{}]}),
]


SHARED = {"A": {"celery": 20}, "B": {"python": 50}, "C": {}, "*": {"celery": 0}}
RAMPED = {**RAMP_A, "D": {"celery": 0}}
RAMP_STEP = {"classes": {"A": {"celery": {"step": 1, "step_since": 1}}}, "history": []}
# The config table at each read of one canary (None: it cannot be read).
READS: list[dict[str, str] | None] = [
    {OPTION: json.dumps(SHARED)},
    None,
    None,
    {OPTION: json.dumps(RAMPED), STATE_OPTION: json.dumps(RAMP_STEP)},
    None,
    {OPTION: json.dumps(RAMPED), STATE_OPTION: json.dumps(state_of({"A": {"celery": rolled()}}))},
    None,
]


class Table:
    """The config table of :data:`READS` to a :class:`CanaryView`, read after read."""

    table_name = "config_entry"

    def __init__(self) -> None:
        self.reads = iter(READS)

    def read(self) -> Canary:
        rows = next(self.reads)
        if rows is None:
            raise OSError("SELECT command denied")
        weights = parse_weights(decode_weights(rows.get(OPTION)))
        return Canary(weights, decode_state(rows.get(STATE_OPTION)))


def raw_of(value: Any) -> str | None:
    """A case's option as its config row holds it (None: no row)."""
    if value is None:
        return None
    return value.text if isinstance(value, Raw) else json.dumps(value)


def shape(message: str) -> str:
    """A refusal without the value it describes (JSON in PHP, ``repr`` in Python) and
    without the JSON decoder's own words."""
    message = re.sub(
        r"(got |not JSON: |not the bridge's state: ).*\Z", r"\1...", message, flags=re.S
    )
    return re.sub(r": [^:]* is outside ", ": ... is outside ", message)


def php_answers(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The buckets and every case's answer, from one php process."""
    php = shutil.which("php")
    if php is None:
        pytest.fail("php is not installed (apt-get install -y php-cli): this test needs it")
    request = {
        "buckets": {"levels": list(LEVELS), "ids": BUCKET_IDS},
        "cases": cases,
        "reads": [{"rows": rows, "classes": CLASSES} for rows in READS],
    }
    done = subprocess.run(
        [php, "-n", str(DRIVER), str(CANARY_PHP)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and not done.stderr, done.stderr or done.stdout
    answers: dict[str, Any] = json.loads(done.stdout)
    return answers


def refusal(read: Callable[[str | None], Any], raw: str | None) -> tuple[Any, str | None]:
    """What ``read(raw)`` gives, or the message of its refusal."""
    try:
        return read(raw), None
    except ValueError as exc:  # ConfigError is one
        return None, str(exc)


def python_answer(case: dict[str, Any]) -> dict[str, Any]:
    """What the PHP driver answers, computed by the bridge's Python."""
    weights, weights_refused = refusal(
        lambda raw: parse_weights(decode_weights(raw)), case["weights"]
    )
    state, state_refused = refusal(
        lambda raw: CanaryState.from_json(read_json(STATE_OPTION, raw)), case["state"]
    )
    # The store's own reading of the state row refuses exactly the same rows.
    assert (state_refused is None) == (refusal(decode_state, case["state"])[1] is None)
    out: dict[str, Any] = {"weightsRefused": weights_refused, "stateRefused": state_refused}
    if weights_refused is not None or state_refused is not None:
        return out
    canary = Canary(weights, state)
    out["named"] = canary.named
    out["weights"] = {c: {lv: canary.weight(c, lv) for lv in LEVELS} for c in case["classes"]}
    closed = canary.closed()
    out["closed"] = {c: {lv: closed.weight(c, lv) for lv in LEVELS} for c in case["classes"]}
    out["takes"] = {
        c: {
            lv: {
                "null" if f is None else str(f): "".join(
                    "1" if canary.takes(lv, c, i, f) else "0" for i in case["ids"]
                )
                for f in case["failures"]
            }
            for lv in LEVELS
        }
        for c in case["classes"]
    }
    return out


@pytest.fixture(scope="module")
def answers() -> Answers:
    cases = [
        {
            "weights": raw_of(weights),
            "state": raw_of(state),
            "classes": CLASSES,
            "ids": IDS,
            "failures": FAILURES,
        }
        for _name, weights, state in CASES
    ]
    return cases, php_answers(cases)


def test_the_buckets_are_pythons(answers: Answers) -> None:
    php = answers[1]["buckets"]
    for level in LEVELS:
        assert php[level] == [bucket(level, i) for i in BUCKET_IDS], level
    # A fifth of the ids below 2000: the hash spreads them.
    share = sum(1 for b in php[CELERY][:10_000] if b < 2000) / 10_000
    assert abs(share - 0.20) <= 0.015, share


@pytest.mark.parametrize("index", range(len(CASES)), ids=[name for name, _, _ in CASES])
def test_php_reads_and_chooses_as_python(answers: Answers, index: int) -> None:
    """The same refusal of either option, or the same weights, named classes and side
    for every class, level, id and failure time."""
    case, php = answers[0][index], answers[1]["cases"][index]
    assert "crash" not in php, php["crash"]
    python = python_answer(case)
    for key, option in (("weightsRefused", OPTION), ("stateRefused", STATE_OPTION)):
        mine, theirs = python[key], php[key]
        assert (mine is None) == (theirs is None), (key, mine, theirs)
        if mine is not None:
            assert mine.startswith(f"{option}: ") and theirs.startswith(f"{option}: ")
            assert shape(mine) == shape(theirs), (mine, theirs)
        python[key], php[key] = mine is None, theirs is None  # compared above
    assert python == php


def test_php_fails_closed_as_python(answers: Answers, caplog: pytest.LogCaptureFixture) -> None:
    """While the table cannot be read, both run the last good weights closed (a shared
    class wholly on its old side, a ramp's step included, a rollback kept), and each
    says so once per outage."""
    view = CanaryView(Table(), refresh=0)  # type: ignore[arg-type]
    caplog.set_level(logging.WARNING, logger="bridge.canary")
    python = []
    for _ in READS:
        canary = view.current()
        python.append({c: {lv: canary.weight(c, lv) for lv in LEVELS} for c in CLASSES})
    assert answers[1]["reads"] == python
    assert answers[1]["logged"] == len(caplog.records) == 3
    assert python[1]["A"][CELERY] == 0 and python[4]["A"][CELERY] == 0


def test_the_table_names_each_case_once() -> None:
    names = [name for name, _, _ in CASES]
    assert len(names) == len(set(names))


def test_python_reads_a_row_as_php_decodes_it() -> None:
    """What the table relies on, said directly: an object keyed 0, 1, ... is PHP's list,
    and what json_decode() refuses is not JSON here either."""
    assert php_json('{"0": "a", "1": {"0": 5}}') == ["a", [5]]
    assert php_json('{"1": "a", "0": "b"}') == {"1": "a", "0": "b"}
    assert php_json('{"": 1, "00": 2}') == {"": 1, "00": 2}
    assert php_json('"\\ud83d\\ude00"') == "\U0001f600"
    assert php_json("[" * 511 + "]" * 511) is not None
    for raw in ("NaN", "[-Infinity]", "[" * 512 + "]" * 512, '"\\ud800"', '{"\\udfff": 1}'):
        with pytest.raises(ValueError):
            php_json(raw)

"""The canary's weights and state (bridge/canary/weights.py): the side a task goes to,
the labels that say who ran it, the option's checks and the state's transitions."""

from __future__ import annotations

import json
import zlib

import pytest

from bridge.canary.weights import (
    CLOSED,
    FELL_BACK,
    HISTORY_PER_CLASS,
    LABEL_ROOM,
    NEW,
    NO_CANARY,
    OLD,
    OPTION,
    SCALE,
    STATE_OPTION,
    Canary,
    CanaryState,
    LevelState,
    bucket,
    canary_of,
    label_parts,
    labelled,
    parse_weights,
    percent,
    run_label,
    side_of,
)
from bridge.errors import ConfigError
from bridge.queue.implementations import CELERY, PYTHON
from bridge.queue.model import label_of

IDS = range(1, 10_001)


def test_the_bucket_is_crc32_of_level_and_id_and_stable():
    assert bucket(CELERY, 42) == zlib.crc32(b"celery:42") % SCALE
    assert bucket(PYTHON, 42) == zlib.crc32(b"python:42") % SCALE
    # Pinned, as PHP's crc32() gives them (a change would move tasks between the sides
    # mid-migration); MySQL's CRC32() is checked in tests/integration/test_canary_store.py.
    assert [bucket(CELERY, n) for n in (1, 2, 1000)] == [3300, 4846, 6057]
    assert [bucket(PYTHON, n) for n in (1, 2, 1000)] == [2374, 3388, 9712]


@pytest.mark.parametrize("level", [CELERY, PYTHON])
@pytest.mark.parametrize("share", [5, 20, 50])
def test_the_new_side_takes_its_share_within_one_and_a_half_points(level, share):
    canary = canary_of({"C": {level: share}}, None)
    taken = sum(canary.takes(level, "C", n, None) for n in IDS)
    assert abs(taken / len(IDS) * 100 - share) <= 1.5
    # The same ids every time: a retry stays where it was sent.
    assert taken == sum(canary.takes(level, "C", n, None) for n in IDS)


def test_the_levels_split_independently():
    at_bridge = {n for n in IDS if bucket(CELERY, n) < 2000}
    at_native = {n for n in IDS if bucket(PYTHON, n) < 2000}
    assert at_bridge != at_native


def test_zero_and_a_hundred_and_a_failed_row():
    canary = canary_of({"Half": {"celery": 50}, "None": {"celery": 0}}, None)
    assert all(canary.takes(CELERY, "Other", n, None) for n in range(50))  # default: 100
    assert all(canary.takes(CELERY, "Other", n, 1700000000) for n in range(50))
    assert not any(canary.takes(CELERY, "None", n, None) for n in range(50))
    # A row that failed (or fell back) is the old side's, whatever its bucket.
    new = [n for n in range(50) if canary.takes(CELERY, "Half", n, None)]
    assert new and not any(canary.takes(CELERY, "Half", n, 1700000000) for n in new)
    assert NO_CANARY.weight("Anything", PYTHON) == SCALE


def test_the_default_entry_applies_to_classes_not_named():
    canary = canary_of({"*": {"celery": 0}, "Moved": {"celery": 100}}, None)
    assert canary.weight("Unnamed", CELERY) == 0
    assert canary.weight("Moved", CELERY) == SCALE
    assert canary.named == ["Moved"]
    assert canary.partial() == []


def test_labels_of_lease_owners():
    assert label_of(None) is None
    assert label_of("1234:1700000000:web01:7") is None  # Phorge's own taskmasters
    assert label_of("phd:1234:1700000000:web01:7") == "phd"
    assert label_of("phd-fallback:1234:1700000000:web01:7") == "phd-fallback"
    assert label_of("bridge:native:1234:1700000000:web01:7") == "native"
    assert label_of("bridge:conduit-fallback:1:1700000000:h:1") == "conduit-fallback"
    owner = "bridge:1234:1700000000:web01:7"
    assert labelled(owner, "runner") == "bridge:runner:1234:1700000000:web01:7"
    assert label_of(labelled(owner, "runner")) == "runner"
    # The epoch stays third from the end.
    assert labelled(owner, "native").split(":")[-3] == "1700000000"
    assert len(":conduit-fallback~99") == LABEL_ROOM


def test_a_runs_label_counts_the_followups_it_queued():
    assert run_label("native", 0) == "native"
    assert run_label("native", 2) == "native~2"
    assert run_label("conduit-fallback", 150) == "conduit-fallback~99", "at most 99"
    assert label_parts("native~2") == ("native", 2)
    assert label_parts("runner") == ("runner", 0)
    assert label_parts(None) == (None, 0)
    assert label_parts("native~x") == ("native", 0)
    assert side_of(PYTHON, "native~2") == "new"
    assert side_of(PYTHON, "runner-fallback~1") == "fallback"
    assert side_of(CELERY, "runner~3") == "new"


@pytest.mark.parametrize(
    ("level", "label", "side"),
    [
        (PYTHON, "native", NEW),
        (PYTHON, "runner", OLD),
        (PYTHON, "conduit", OLD),
        (PYTHON, "runner-fallback", FELL_BACK),
        (PYTHON, "conduit-fallback", FELL_BACK),
        (CELERY, None, OLD),
        (CELERY, "phd", OLD),
        (CELERY, "phd-fallback", FELL_BACK),
        (CELERY, "native", NEW),
        (CELERY, "runner", NEW),
        (CELERY, "conduit", NEW),
    ],
)
def test_side_of_a_label(level, label, side):
    assert side_of(level, label) == side


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ({"Mail": {"celery": 101}}, "Mail.celery"),
        ({"Mail": {"celery": -1}}, "Mail.celery"),
        ({"Mail": {"celery": "5"}}, "Mail.celery"),
        ({"Mail": {"celery": True}}, "Mail.celery"),
        ({"Mail": {"natve": 5}}, "Mail"),
        ({"Mail": 5}, "Mail"),
        ({"Mail": {"ramp": {"level": "phd", "steps": [1]}}}, "Mail.ramp.level"),
        ({"Mail": {"ramp": {"level": "celery", "steps": [5, 1]}}}, "Mail.ramp.steps"),
        ({"Mail": {"ramp": {"level": "celery", "steps": [0, 5]}}}, "Mail.ramp.steps"),
        ({"Mail": {"ramp": {"level": "celery", "steps": []}}}, "Mail.ramp.steps"),
        ({"Mail": {"ramp": {"level": "celery", "steps": [5], "dwell": 0}}}, "Mail.ramp.dwell"),
        # Past PHP's integers: a float there.
        ({"Mail": {"ramp": {"level": "celery", "steps": [5], "dwell": 2**63}}}, "Mail.ramp.dwell"),
        ({"Mail": {"ramp": []}}, "Mail.ramp.level"),  # PHP's {}: no level
        ({"Mail": {"celery": 5, "ramp": {"level": "celery", "steps": [5]}}}, "Mail"),
        ({"*": {"celery": 5}}, "*"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_weights_name_the_option_and_the_class(value, names):
    with pytest.raises(ConfigError) as raised:
        parse_weights(value)
    assert raised.value.setting == OPTION
    assert str(raised.value).startswith(f"{OPTION}: ")
    assert names in str(raised.value)


def test_only_one_level_may_be_shared():
    with pytest.raises(ConfigError, match="Mail: only one level may be shared at a time"):
        parse_weights({"Mail": {"celery": 50, "python": 50}})
    with pytest.raises(ConfigError, match="only one level"):
        parse_weights({"Mail": {"python": 20, "ramp": {"level": "celery", "steps": [5]}}})
    # One level shared, the other at 0 or 100: one level shares the class.
    assert parse_weights({"Mail": {"celery": 100, "python": 20}})["Mail"].python == 2000
    assert parse_weights({"Mail": {"celery": 0, "python": 20}})["Mail"].python == 2000
    ramped = parse_weights({"Mail": {"python": 0, "ramp": {"level": "celery", "steps": [5]}}})
    assert (ramped["Mail"].celery, ramped["Mail"].python) == (SCALE, 0)


def test_php_writes_an_empty_option_as_an_empty_array():
    assert parse_weights([]) == {} and parse_weights(None) == {}
    assert CanaryState.from_json([]) == CanaryState()
    assert CanaryState.from_json({"classes": [], "history": []}) == CanaryState()
    assert CanaryState.from_json({"classes": {"C": []}, "history": {}}) == CanaryState()
    state = CanaryState.from_json({"classes": {"C": {"celery": [], "python": {"rolled_back": []}}}})
    assert state.of("C", CELERY) == state.of("C", PYTHON) == LevelState()


@pytest.mark.parametrize("entry", [{}, []])  # `bin/config set '{"X": {}}'` stores {"X":[]}
def test_a_level_left_out_is_the_defaults(entry):
    canary = canary_of({"*": {"celery": 0}, "X": entry, "Y": {"python": 50}}, None)
    assert (canary.weight("X", CELERY), canary.weight("X", PYTHON)) == (0, SCALE)
    # Named at the python level only, Y stays with phd: a share of nothing, yet.
    assert (canary.weight("Y", CELERY), canary.weight("Y", PYTHON)) == (0, 5000)
    assert canary.weight("Other", CELERY) == 0 and canary.named == ["X", "Y"]
    # A ramp's own level starts from its first step, whatever the default says.
    ramped = canary_of({"*": {"celery": 0}, "Z": {"ramp": {"level": "celery", "steps": [5]}}}, None)
    assert ramped.weight("Z", CELERY) == 500
    # Without a default, a level left out is 100: `{}` is the class wholly new.
    assert canary_of({"X": entry}, None).weight("X", CELERY) == SCALE


def test_decimals_are_basis_points():
    assert parse_weights({"C": {"python": 0.05}})["C"].python == 5
    assert percent(5) == 0.05 and percent(2000) == 20


RAMP = {"C": {"ramp": {"level": "python", "steps": [1, 5, 25, 100], "dwell": 60}}}


def test_effective_weight_follows_the_ramp_then_the_rollback():
    state = CanaryState()
    canary = canary_of(RAMP, state.to_json())
    assert canary.weight("C", PYTHON) == 100 and canary.level_of("C") == PYTHON
    assert canary.partial() == [("C", PYTHON, 100)]
    state = state.with_step("C", PYTHON, 1000, 2, 25.0)
    assert canary_of(RAMP, state.to_json()).weight("C", PYTHON) == 2500
    state = state.with_step("C", PYTHON, 1060, 7, 100.0)  # past the end: clamped
    assert canary_of(RAMP, state.to_json()).weight("C", PYTHON) == SCALE
    state = state.with_rollback("C", PYTHON, 1100, "worse")
    rolled = canary_of(RAMP, state.to_json())
    assert rolled.weight("C", PYTHON) == 0 and rolled.level_of("C") is None
    assert rolled.weight("C", CELERY) == SCALE  # the other level is untouched
    assert rolled.partial() == []
    # Promotion clears it, and the ramp starts again from its first step.
    promoted = state.with_promotion("C", PYTHON, 1200, 1.0, "fixed")
    again = canary_of(RAMP, promoted.to_json())
    assert again.weight("C", PYTHON) == 100
    assert again.state.of("C", PYTHON) == LevelState(step=0, step_since=1200)


def test_a_rollback_of_a_fixed_weight_and_its_promotion():
    weights = {"C": {"celery": 5}}
    state = CanaryState().with_rollback("C", CELERY, 10, "by hand")
    assert canary_of(weights, state.to_json()).weight("C", CELERY) == 0
    # Also for a class not named at all (a class wholly moved, sent back).
    assert canary_of({}, state.to_json()).weight("C", CELERY) == 0
    promoted = state.with_promotion("C", CELERY, 20, 5.0)
    assert canary_of(weights, promoted.to_json()).weight("C", CELERY) == 500


def test_the_state_round_trips_through_json():
    state = (
        CanaryState()
        .with_rollback("A", PYTHON, 100, "new side success 70.0%")
        .with_step("B", CELERY, 200, 1, 5.0)
        .with_promotion("A", PYTHON, 300, 20.0, "fixed in 1.2")
        .with_rollback("B", CELERY, 400, "slow")
        .with_step("B", CELERY, 500, 2, 25.0, "by hand", event="promote")
        .with_pause("B", CELERY, 600, True, 25.0)
    )
    text = json.dumps(state.to_json())
    assert CanaryState.from_json(json.loads(text)) == state
    value = json.loads(text)
    assert value["classes"]["B"]["celery"]["rolled_back"] == {"at": 400, "reason": "slow"}
    assert "rolled_back" not in value["classes"]["A"]["python"]
    assert value["classes"]["B"]["celery"]["paused"] is True
    assert "paused" not in value["classes"]["A"]["python"]  # absent unless paused
    assert [e["event"] for e in value["history"]] == [
        "rollback",
        "step",
        "promote",
        "rollback",
        "promote",
        "pause",
    ]
    assert value["history"][0] == {
        "at": 100,
        "class": "A",
        "level": "python",
        "event": "rollback",
        "weight": 0,
        "reason": "new side success 70.0 percent",  # no "%": `bin/config get` formats it
    }


@pytest.mark.parametrize(
    "value",
    [
        {"classes": {"A": {"python": {"step": "x"}}}},
        {"history": [{"at": 1}]},
        [1],
        # A step is an integer from 0 (PHP's): never a string, a float, a bool, negative.
        *({"classes": {"A": {"python": {"step": step}}}} for step in ("2", 1.0, True, -1, 2**63)),
        {"classes": None},
        {"classes": {"A": None}},
        {"history": None},
        {"history": ""},
        {"classes": {"A": {"python": {"rolled_back": False}}}},
    ],
)
def test_a_state_the_bridge_did_not_write_is_refused(value):
    with pytest.raises(ValueError, match=STATE_OPTION):
        CanaryState.from_json(value)


def test_history_keeps_the_newest_fifty_events_per_class():
    state = CanaryState().with_rollback("Other", CELERY, 1, "kept")
    for at in range(2, 2 + 2 * HISTORY_PER_CLASS):
        state = state.with_step("C", PYTHON, at, at, 1.0)
    mine = [e for e in state.history if e.task_class == "C"]
    assert len(mine) == HISTORY_PER_CLASS
    assert [e.at for e in mine] == list(range(2 + HISTORY_PER_CLASS, 2 + 2 * HISTORY_PER_CLASS))
    assert [e.task_class for e in state.history].count("Other") == 1
    assert state.history[-1].at == 1 + 2 * HISTORY_PER_CLASS  # newest last
    assert CanaryState.from_json(state.to_json()) == state


def test_a_canary_holds_its_weights_and_state():
    canary = Canary(parse_weights({"C": {"python": 20}}), CanaryState())
    assert canary.configured("C").python == 2000
    assert canary.configured("D").python == SCALE


def test_a_closed_canary_runs_no_new_side_of_a_shared_class():
    weights = {
        "Shared": {"celery": 20},
        "Native": {"python": 50},
        "Ramped": {"ramp": {"level": "celery", "steps": [5, 50]}},
        "Moved": {},
        "Kept": {"celery": 0},
        "*": {"celery": 100},
    }
    state = CanaryState().with_step("Ramped", CELERY, 10, 1, 50.0)
    state = state.with_rollback("Gone", CELERY, 20, "worse")
    canary = canary_of(weights, state.to_json())
    assert (canary.weight("Ramped", CELERY), canary.weight("Native", CELERY)) == (5000, SCALE)
    closed = canary.closed()
    expected = {
        "Shared": (0, SCALE),
        "Native": (SCALE, 0),
        "Ramped": (0, SCALE),
        "Moved": (SCALE, SCALE),
        "Kept": (0, SCALE),
        "Gone": (0, SCALE),  # its rollback stays in force
        "Unnamed": (SCALE, SCALE),
    }
    assert {c: (closed.weight(c, CELERY), closed.weight(c, PYTHON)) for c in expected} == expected
    assert closed.partial() == [] and closed.state == canary.state
    assert closed.unread and not canary.unread, "a worker stands by on what it hands back"
    # Closing a closed canary changes nothing; without a canary nothing is shared.
    assert closed.closed() == closed and NO_CANARY.closed().weights == NO_CANARY.weights


def test_before_any_read_no_class_runs_on_either_new_side():
    assert CLOSED.active and not NO_CANARY.active
    assert not any(
        CLOSED.takes(level, task_class, task_id, None)
        for level in (CELERY, PYTHON)
        for task_class in ("A", "PhabricatorSearchWorker")
        for task_id in IDS
    )

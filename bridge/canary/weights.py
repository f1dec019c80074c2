"""The canary's weights and state, as Phorge's config options hold them, and the side a
task goes to.

The operator sets ``phorge-bridge.canary`` (``bin/config set --database``); the bridge
alone writes ``phorge-bridge.canary-state`` (rollbacks, ramp steps, their history). The
choice of side is a hash of the task id that PHP (``PhorgeBridgeCanary.php``) and SQL
(``CRC32``) compute alike, so the bridge's poll, its workers and the shipped daemon agree
on every row without talking to each other. A row that ever failed (``failureTime``
set: an old-side failure, or a fallback from the new side) stays with the old side.

The parsers take the values as PHP's ``json_decode($raw, true)`` gives them (the store
decodes the rows so), where ``[]`` is also ``{}``: both sides accept and refuse the same
values, as tests/unit/test_canary_php_parity.py checks against the PHP itself.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from bridge.errors import ConfigError
from bridge.phorge.php import PHP_INT
from bridge.queue.dialect import BUCKETS
from bridge.queue.implementations import CELERY, CONDUIT, LEVELS, NATIVE, PHD, PYTHON

SCALE = BUCKETS  # weights in basis points (0.01% steps): one per bucket of the hash
OPTION = "phorge-bridge.canary"
STATE_OPTION = "phorge-bridge.canary-state"
DEFAULT = "*"  # the key of the weights of every class not named
DEFAULT_DWELL = 600
HISTORY_PER_CLASS = 50

FALLBACK = "-fallback"  # suffix of a run of a row that fell back from the new side
FOLLOWED = "~"  # then the follow-ups a successful run queued, when it queued any
MAX_FOLLOWUPS = 99  # the most a label counts
# What an owner keeps free for its label (``:conduit-fallback~99``).
LABEL_ROOM = len(f":{CONDUIT}{FALLBACK}{FOLLOWED}{MAX_FOLLOWUPS}")
NEW, OLD, FELL_BACK = "new", "old", "fallback"


def bucket(level: str, task_id: int) -> int:
    """The task's place in 0..9999 at ``level``: ``crc32('level:id') % 10000``, the same
    as PHP's ``crc32()`` and MySQL's ``CRC32()``."""
    return zlib.crc32(f"{level}:{task_id}".encode()) % SCALE


def labelled(owner: str, label: str) -> str:
    """``owner`` (``prefix:pid:epoch:host:seq``) with ``label`` after its prefix."""
    prefix, rest = owner.split(":", 1)
    return f"{prefix}:{label}:{rest}"


def run_label(implementation: str, followups: int) -> str:
    """A run's label: who ran it, and how many follow-ups it queued when any
    (``native~2``, at most :data:`MAX_FOLLOWUPS`): the guard compares the sides' effects,
    not only their outcomes, and Phorge's schema has no other place for the count."""
    if followups <= 0:
        return implementation
    return f"{implementation}{FOLLOWED}{min(followups, MAX_FOLLOWUPS)}"


def label_parts(label: str | None) -> tuple[str | None, int]:
    """:func:`run_label`'s parts: who ran the task, and the follow-ups it queued."""
    if label is None or FOLLOWED not in label:
        return label, 0
    who, _, count = label.rpartition(FOLLOWED)
    return who, int(count) if count.isdigit() else 0


def side_of(level: str, label: str | None) -> str:
    """Which side of ``level`` a run with ``label`` was: :data:`NEW`, :data:`OLD`, or
    :data:`FELL_BACK` (an old-side run of a row the new side failed)."""
    label = label_parts(label)[0]
    if label is not None and label.endswith(FALLBACK):
        return FELL_BACK
    if level == PYTHON:
        return NEW if label == NATIVE else OLD
    return OLD if label in (None, PHD) else NEW


def _object(value: Any) -> Mapping[str, Any] | None:
    """``value`` as a JSON object, None when it is not one. ``[]`` is the empty object:
    PHP's ``json_encode()`` writes ``{}`` so (``bin/config set '{"X": {}}'`` stores
    ``{"X":[]}``)."""
    if isinstance(value, Mapping):
        return value
    return {} if value == [] else None


def _as_object(value: Any) -> Mapping[str, Any]:
    found = _object(value)
    if found is None:
        raise TypeError(f"expected an object, got {value!r}")
    return found


def _php_int(value: Any) -> bool:
    """Whether ``value`` is an integer PHP reads as one (beyond 64 bits it is a float)."""
    return isinstance(value, int) and not isinstance(value, bool) and value in PHP_INT


def _percent(value: Any, where: str, low_open: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(OPTION, f"{where}: expected a percentage, got {value!r}")
    if not (0 < value <= 100 if low_open else 0 <= value <= 100):
        raise ConfigError(
            OPTION, f"{where}: {value!r} is outside {'(0' if low_open else '[0'}, 100]"
        )
    return round(value * SCALE / 100)


@dataclass(frozen=True)
class Ramp:
    """A progressive schedule at one level: each step (basis points) held ``dwell`` s."""

    level: str
    steps: tuple[int, ...]
    dwell: int = DEFAULT_DWELL


@dataclass(frozen=True)
class ClassWeights:
    """A class's configured weights (basis points), before rollbacks, and the guard's
    bounds it sets for itself (``BRIDGE_CANARY_*`` names, lower-cased, without the
    prefix: ``max_drop``, ...)."""

    celery: int = SCALE
    python: int = SCALE
    ramp: Ramp | None = None
    guard: tuple[tuple[str, float], ...] = ()

    def at(self, level: str) -> int:
        return self.celery if level == CELERY else self.python

    def bound(self, name: str, default: float) -> float:
        """The class's own guard bound ``name``, else ``default`` (the setting's)."""
        return dict(self.guard).get(name, default)


def _ramp(given: Any, where: str) -> Ramp:
    value = _object(given)
    if value is None or set(value) - {"level", "steps", "dwell"}:
        raise ConfigError(OPTION, f"{where}.ramp: expected {{level, steps, dwell}}, got {given!r}")
    level = value.get("level")
    if level not in LEVELS:
        raise ConfigError(OPTION, f"{where}.ramp.level: expected celery or python, got {level!r}")
    steps = value.get("steps")
    if not isinstance(steps, list) or not steps:
        raise ConfigError(OPTION, f"{where}.ramp.steps: expected a list of percentages")
    bps = tuple(_percent(step, f"{where}.ramp.steps", low_open=True) for step in steps)
    if list(bps) != sorted(set(bps)):
        raise ConfigError(OPTION, f"{where}.ramp.steps: must rise, got {steps!r}")
    dwell = value.get("dwell", DEFAULT_DWELL)
    if not _php_int(dwell) or dwell <= 0:
        raise ConfigError(OPTION, f"{where}.ramp.dwell: expected seconds > 0, got {dwell!r}")
    return Ramp(level, bps, dwell)


def _whole(value: Any) -> bool:
    return _php_int(value) and value >= 1


def _number(value: Any) -> bool:
    """A finite number (an integer past 64 bits too: PHP reads it as a float)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# A class's own guard bounds: each the check and the words of its setting's.
GUARD_BOUNDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "min_runs": (_whole, "a positive integer"),
    "min_failures": (_whole, "a positive integer"),
    "failure_limit": (_whole, "a positive integer"),
    "max_drop": (lambda v: _number(v) and 0 <= v <= 1, "a number from 0 to 1"),
    "significance": (
        lambda v: _number(v) and 0 < v < 1,
        "a number between 0 and 1 (exclusive)",
    ),
    "max_slowdown": (lambda v: _number(v) and v >= 1, "a number of at least 1"),
    "slowdown_floor": (lambda v: _number(v) and v > 0, "a positive number of seconds"),
    "max_followup_change": (lambda v: _number(v) and 0 <= v <= 1, "a number from 0 to 1"),
    "max_yielding": (_whole, "a positive integer of seconds"),
}


def _guard(given: Any, name: str) -> tuple[tuple[str, float], ...]:
    value = _object(given)
    if value is None or set(value) - set(GUARD_BOUNDS):
        known = ", ".join(GUARD_BOUNDS)
        raise ConfigError(OPTION, f"{name}.guard: expected an object of {known}, got {given!r}")
    for key, bound in value.items():
        valid, expected = GUARD_BOUNDS[key]
        if not valid(bound):
            raise ConfigError(OPTION, f"{name}.guard.{key}: expected {expected}, got {bound!r}")
    return tuple((key, value[key]) for key in GUARD_BOUNDS if key in value)


def _class_weights(name: str, given: Any, default: ClassWeights) -> ClassWeights:
    """A class's entry; a level it leaves out has the ``"*"`` entry's weight (100 without
    one), but for a ramp's own level: naming a class at one level moves it at no other."""
    value = _object(given)
    if value is None or set(value) - {CELERY, PYTHON, "ramp", "guard"}:
        raise ConfigError(
            OPTION,
            f"{name}: expected an object with celery, python, ramp or guard, got {given!r}",
        )
    given_bp = {lv: _percent(value[lv], f"{name}.{lv}") for lv in LEVELS if lv in value}
    ramp = _ramp(value["ramp"], name) if "ramp" in value else None
    if ramp is not None and given_bp.get(ramp.level, SCALE) != SCALE:
        raise ConfigError(OPTION, f"{name}: a ramp sets the {ramp.level} weight itself")

    def at(level: str) -> int:
        if level in given_bp:
            return given_bp[level]
        return SCALE if ramp is not None and ramp.level == level else default.at(level)

    guard = _guard(value["guard"], name) if "guard" in value else ()
    weights = ClassWeights(celery=at(CELERY), python=at(PYTHON), ramp=ramp, guard=guard)
    shared = {level for level in LEVELS if 0 < weights.at(level) < SCALE}
    if ramp is not None:
        shared.add(ramp.level)
    if len(shared) > 1:
        raise ConfigError(OPTION, f"{name}: only one level may be shared at a time")
    if name == DEFAULT and (
        weights.ramp or "guard" in value or any(weights.at(lv) not in (0, SCALE) for lv in LEVELS)
    ):
        raise ConfigError(
            OPTION, f"{DEFAULT}: the default weights are 0 or 100, without a ramp or guard"
        )
    return weights


def parse_weights(value: Any) -> dict[str, ClassWeights]:
    """The option's value (decoded JSON; None or ``[]`` when unset) as weights per class;
    raises ConfigError naming the option and the class."""
    if value in (None, [], {}):
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(OPTION, f"expected a JSON object of task classes, got {value!r}")
    default = ClassWeights()
    if DEFAULT in value:
        default = _class_weights(DEFAULT, value[DEFAULT], default)
    return {
        str(name): default if name == DEFAULT else _class_weights(str(name), entry, default)
        for name, entry in value.items()
    }


def with_weight(value: Any, task_class: str, level: str, weight: float) -> dict[str, Any]:
    """The option's value (decoded JSON) with ``task_class`` at ``weight`` percent at
    ``level``, every other class and level as it was; raises ConfigError when a ramp
    owns that level (whether the result is valid is the store's to check)."""
    current = dict(_as_object(value)) if value is not None else {}
    entry = dict(_object(current.get(task_class)) or {})
    ramp = _object(entry.get("ramp"))
    if ramp is not None and ramp.get("level") == level:
        raise ConfigError(
            OPTION, f"{task_class}: its ramp sets the {level} weight (unset it first)"
        )
    entry[level] = int(weight) if float(weight).is_integer() else weight
    return {**current, task_class: entry}


def without_weight(value: Any, task_class: str, level: str | None) -> dict[str, Any]:
    """The option's value without ``task_class``'s weight (and ramp) at ``level``, or
    without its entry (``level`` None): it then has the ``"*"`` entry's weights. Raises
    ConfigError when the option does not name it so."""
    current = dict(_as_object(value)) if value is not None else {}
    entry = _object(current.get(task_class))
    if entry is None:
        raise ConfigError(OPTION, f"{task_class}: not named")
    kept = dict(entry)
    if level is not None:
        ramp = _object(kept.get("ramp"))
        if level not in kept and (ramp is None or ramp.get("level") != level):
            raise ConfigError(OPTION, f"{task_class}: no {level} weight is set")
        kept.pop(level, None)
        if ramp is not None and ramp.get("level") == level:
            del kept["ramp"]
    changed = {k: v for k, v in current.items() if k != task_class}
    if level is not None and kept:
        changed[task_class] = kept
    return changed


@dataclass(frozen=True)
class LevelState:
    """What the bridge decided for one class and level: rolled back (since when, why),
    the ramp step reached (since when), and the version of the new side the guard last
    saw the live workers announce."""

    rolled_back_at: int | None = None
    reason: str = ""
    step: int = 0
    step_since: int | None = None
    paused: bool = False  # an operator's pause: the guard holds the ramp at its step
    version: str | None = None

    @property
    def rolled_back(self) -> bool:
        return self.rolled_back_at is not None


VERSION = "version"  # the event of a new version on the new side
FRESH_EVENTS = ("promote", VERSION)  # the events the guard judges afresh from


@dataclass(frozen=True)
class Event:
    """One line of a class's history: a rollback, a promotion, a ramp step, a pause or
    its end, or a new version on the new side."""

    at: int
    task_class: str
    level: str
    event: str
    weight: float  # percent, after the event
    reason: str = ""


def stored(reason: str) -> str:
    """A reason as the state keeps it: without ``%``, which ``bin/config get`` would take
    for a format directive of its own (it prints the value through a format string)."""
    return reason.replace("%", " percent")


@dataclass(frozen=True)
class CanaryState:
    """The bridge's record (``phorge-bridge.canary-state``)."""

    levels: Mapping[tuple[str, str], LevelState] = field(default_factory=dict)
    history: tuple[Event, ...] = ()

    def of(self, task_class: str, level: str) -> LevelState:
        return self.levels.get((task_class, level), LevelState())

    @classmethod
    def from_json(cls, value: Any) -> CanaryState:
        """Read the option's value; raises ValueError when it is not what the bridge
        writes (``to_json``, with PHP's ``[]`` for an empty object): a ``step`` is an
        integer from 0, a level is rolled back once its ``rolled_back`` has an ``at``."""
        if value is None:
            return cls()
        try:
            state = _as_object(value)
            history = state.get("history", [])
            if not isinstance(history, list) and history != {}:
                raise TypeError("history: not a list")
            levels = {
                (name, level): cls._level(_as_object(entry))
                for name, by_level in _as_object(state.get("classes", {})).items()
                for level, entry in _as_object(by_level).items()
            }
            events = tuple(
                Event(e["at"], e["class"], e["level"], e["event"], e["weight"], e.get("reason", ""))
                for e in history
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{STATE_OPTION}: not the bridge's state: {value!r}") from exc
        return cls(levels, events)

    @staticmethod
    def _level(entry: Mapping[str, Any]) -> LevelState:
        step = entry.get("step", 0)
        if not _php_int(step) or step < 0:
            raise TypeError(f"step: expected an integer from 0, got {step!r}")
        rolled_back = entry.get("rolled_back")
        since = {} if rolled_back is None else _as_object(rolled_back)
        version = entry.get("version")
        if version is not None and not isinstance(version, str):
            raise TypeError(f"version: expected a string, got {version!r}")
        return LevelState(
            since.get("at"),
            since.get("reason", ""),
            step,
            entry.get("step_since"),
            entry.get("paused") is True,
            version,
        )

    def to_json(self) -> dict[str, Any]:
        classes: dict[str, dict[str, Any]] = {}
        for (name, level), state in sorted(self.levels.items()):
            entry: dict[str, Any] = {"step": state.step, "step_since": state.step_since}
            if state.paused:
                entry["paused"] = True
            if state.version is not None:
                entry["version"] = state.version
            if state.rolled_back:
                entry["rolled_back"] = {"at": state.rolled_back_at, "reason": state.reason}
            classes.setdefault(name, {})[level] = entry
        history = [
            {
                "at": e.at,
                "class": e.task_class,
                "level": e.level,
                "event": e.event,
                "weight": e.weight,
                "reason": e.reason,
            }
            for e in self.history
        ]
        return {"classes": classes, "history": history}

    def _with(self, task_class: str, level: str, state: LevelState, event: Event) -> CanaryState:
        event = replace(event, reason=stored(event.reason))
        levels = {**self.levels, (task_class, level): state}
        mine = [e for e in self.history if e.task_class == task_class]
        dropped = set(map(id, mine[: max(0, len(mine) + 1 - HISTORY_PER_CLASS)]))
        history = (*(e for e in self.history if id(e) not in dropped), event)
        return CanaryState(levels, history)

    def judged_since(self, task_class: str, level: str) -> int | None:
        """Since when the guard judges ``task_class`` at ``level`` afresh: an operator's
        last promotion (not the failures that made the rollback), or the last new version
        of its new side (a new revision, as Flagger starts its analysis again for one)."""
        times = [
            e.at
            for e in self.history
            if (e.task_class, e.level) == (task_class, level) and e.event in FRESH_EVENTS
        ]
        return max(times, default=None)

    def with_version(
        self, task_class: str, level: str, at: int, version: str, weight: float
    ) -> CanaryState:
        """``version`` seen on the new side: a change from the one recorded is a history
        event that starts a fresh judgement; a first sight is only recorded (what was
        judged so far ran it)."""
        seen = self.of(task_class, level)
        state = replace(seen, version=version)
        if seen.version is None:
            return CanaryState({**self.levels, (task_class, level): state}, self.history)
        event = Event(at, task_class, level, VERSION, weight, f"{seen.version} -> {version}")
        return self._with(task_class, level, state, event)

    def with_rollback(self, task_class: str, level: str, at: int, reason: str) -> CanaryState:
        reason = stored(reason)
        state = replace(self.of(task_class, level), rolled_back_at=at, reason=reason)
        return self._with(
            task_class, level, state, Event(at, task_class, level, "rollback", 0, reason)
        )

    def with_promotion(
        self, task_class: str, level: str, at: int, weight: float, reason: str = ""
    ) -> CanaryState:
        """Rollback cleared; a ramp starts again from its first step."""
        state = LevelState(step=0, step_since=at, version=self.of(task_class, level).version)
        return self._with(
            task_class, level, state, Event(at, task_class, level, "promote", weight, reason)
        )

    def with_pause(
        self, task_class: str, level: str, at: int, paused: bool, weight: float, reason: str = ""
    ) -> CanaryState:
        """The ramp held at its step (``paused``), or going on from it: its dwell starts
        again at ``at``, so a resumed ramp does not step at once."""
        state = replace(self.of(task_class, level), paused=paused, step_since=at)
        event = Event(at, task_class, level, "pause" if paused else "resume", weight, reason)
        return self._with(task_class, level, state, event)

    def with_step(
        self,
        task_class: str,
        level: str,
        at: int,
        step: int,
        weight: float,
        reason: str = "",
        event: str = "step",
    ) -> CanaryState:
        """The ramp at ``step`` from ``at`` (the guard's ``step``, an operator's
        ``promote``)."""
        state = replace(self.of(task_class, level), step=step, step_since=at)
        return self._with(
            task_class, level, state, Event(at, task_class, level, event, weight, reason)
        )


@dataclass(frozen=True)
class Canary:
    """The weights in force: configured, then ramped, then rolled back. ``unread``: the
    process cannot read them, and runs these, the closed ones (:meth:`closed`)."""

    weights: Mapping[str, ClassWeights] = field(default_factory=dict)
    state: CanaryState = field(default_factory=CanaryState)
    unread: bool = False

    def configured(self, task_class: str) -> ClassWeights:
        return self.weights.get(task_class) or self.weights.get(DEFAULT) or ClassWeights()

    def weight(self, task_class: str, level: str) -> int:
        """The share (basis points) of ``task_class``'s tasks the new side of ``level`` runs."""
        configured = self.configured(task_class)
        state = self.state.of(task_class, level)
        if state.rolled_back:
            return 0
        ramp = configured.ramp
        if ramp is not None and ramp.level == level:
            return ramp.steps[min(state.step, len(ramp.steps) - 1)]
        return configured.at(level)

    def takes(self, level: str, task_class: str, task_id: int, failure_time: int | None) -> bool:
        """Whether the new side of ``level`` runs this task (see the module's docstring)."""
        weight = self.weight(task_class, level)
        if weight >= SCALE:
            return True
        if weight <= 0 or failure_time is not None:
            return False
        return bucket(level, task_id) < weight

    def level_of(self, task_class: str) -> str | None:
        """The level at which ``task_class`` is shared (0 < weight < 100), if one is."""
        for level in LEVELS:
            if 0 < self.weight(task_class, level) < SCALE:
                return level
        return None

    def partial(self) -> list[tuple[str, str, int]]:
        """``(class, level, weight)`` of every named class shared between two sides."""
        shared = []
        for name in self.weights:
            level = self.level_of(name) if name != DEFAULT else None
            if level is not None:
                shared.append((name, level, self.weight(name, level)))
        return shared

    @property
    def active(self) -> bool:
        """Whether any weight or state is in force: without, a task pays no canary test."""
        return bool(self.weights or self.state.levels)

    def closed(self) -> Canary:
        """The canary as a process runs it while it cannot read the options: the new side
        of every class shared at a level (0 < weight < 100, a ramp's step included) runs
        none of it there; classes wholly on one side, and rollbacks, stay as they were."""

        def shut(name: str, level: str) -> int:
            weight = self.weight(name, level)
            return 0 if 0 < weight < SCALE else weight

        weights = {
            name: ClassWeights(celery=shut(name, CELERY), python=shut(name, PYTHON))
            for name in self.weights
        }
        return Canary(weights, self.state, unread=True)

    @property
    def named(self) -> list[str]:
        """The classes the option or the state names."""
        names = {n for n in self.weights if n != DEFAULT}
        return sorted(names | {name for name, _ in self.state.levels})


NO_CANARY = Canary()
# Before any read: no class runs on the new side of either level, since any may be shared.
CLOSED = Canary({DEFAULT: ClassWeights(celery=0, python=0)}, unread=True)


def canary_of(weights: Any, state: Any) -> Canary:
    """The canary the two options' values (decoded JSON) make; raises ConfigError for bad
    weights, ValueError for a state the bridge did not write."""
    return Canary(parse_weights(weights), CanaryState.from_json(state))


def percent(bp: int) -> float:
    """Basis points as the percentage an operator wrote."""
    return bp * 100 / SCALE

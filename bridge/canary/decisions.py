"""The canary's decisions on one class and level, written once here for the guard
and the operator's CLI alike: roll back, promote, step a ramp, pause or resume it, and
record the new side's version.

Each reads the state under its row lock (``CanaryStore.change_state``) and changes it only
when it still holds what the decision was made on, so a guard and an operator (or two
guards) never undo each other; each returns what it did, and the callers say it (the
guard's log, the CLI's line).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from bridge.canary.store import CanaryStore
from bridge.canary.weights import Canary, CanaryState, percent

CLEARED, NEXT_STEP = "rollback cleared", "next ramp step"  # what a promotion did


@dataclass(frozen=True)
class Decided:
    """A decision's result: whether it changed the state, and the state as it stands."""

    done: bool
    state: CanaryState


def roll_back(store: CanaryStore, task_class: str, level: str, now: int, reason: str) -> Decided:
    """The new side's weight to 0 until a promotion; not done when it already was."""
    done = False

    def change(state: CanaryState) -> CanaryState:
        nonlocal done
        done = not state.of(task_class, level).rolled_back
        return state.with_rollback(task_class, level, now, reason) if done else state

    state = store.change_state(change)  # before ``done`` is read: the change sets it
    return Decided(done, state)


def promote(
    store: CanaryStore, canary: Canary, task_class: str, level: str, now: int, reason: str
) -> tuple[str, CanaryState]:
    """Clear the rollback (a ramp starts again at its first step), else move a ramp to its
    next step; what it did (:data:`CLEARED`, :data:`NEXT_STEP`, or "" for nothing) and
    the state as it stands."""
    ramp = canary.configured(task_class).ramp
    if ramp is not None and ramp.level != level:
        ramp = None
    what = ""

    def change(state: CanaryState) -> CanaryState:
        nonlocal what
        mine = state.of(task_class, level)
        if mine.rolled_back:
            what = CLEARED
            cleared = Canary(canary.weights, state.with_promotion(task_class, level, now, 0))
            after = percent(cleared.weight(task_class, level))
            return state.with_promotion(task_class, level, now, after, reason)
        if ramp is not None and mine.step + 1 < len(ramp.steps):
            what = NEXT_STEP
            step = mine.step + 1
            after = percent(ramp.steps[step])
            return state.with_step(task_class, level, now, step, after, reason, event="promote")
        what = ""
        return state

    state = store.change_state(change)  # before ``what`` is read: the change sets it
    return what, state


def step_ramp(
    store: CanaryStore, canary: Canary, task_class: str, level: str, now: int
) -> float | None:
    """A quiet ramp's next step (its weight, percent) once the current one was held its
    dwell, unless the state changed since ``canary`` was read (a CLI, another guard);
    None otherwise. A step first seen starts its dwell now."""
    ramp = canary.configured(task_class).ramp
    seen = canary.state.of(task_class, level)
    if ramp is None or ramp.level != level or seen.rolled_back or seen.paused:
        return None
    if seen.step_since is None:

        def start(state: CanaryState) -> CanaryState:
            current = state.of(task_class, level)
            if current.step_since is not None or current.rolled_back:
                return state
            started = replace(current, step_since=now)
            return replace(state, levels={**state.levels, (task_class, level): started})

        store.change_state(start)
        return None
    step = seen.step + 1
    if step >= len(ramp.steps) or now - seen.step_since < ramp.dwell:
        return None
    weight = percent(ramp.steps[step])
    stepped = False

    def advance(state: CanaryState) -> CanaryState:
        nonlocal stepped
        stepped = state.of(task_class, level) == seen
        return state.with_step(task_class, level, now, step, weight) if stepped else state

    store.change_state(advance)
    return weight if stepped else None


def hold_ramp(
    store: CanaryStore,
    canary: Canary,
    task_class: str,
    level: str,
    now: int,
    paused: bool,
    reason: str,
) -> Decided:
    """Pause the ramp at its step (the guard steps it no further), or let it go on (its
    dwell starts again now); not done when it already was so."""
    weight = percent(canary.weight(task_class, level))
    done = False

    def change(state: CanaryState) -> CanaryState:
        nonlocal done
        done = state.of(task_class, level).paused != paused
        return state.with_pause(task_class, level, now, paused, weight, reason) if done else state

    state = store.change_state(change)  # before ``done`` is read: the change sets it
    return Decided(done, state)


def record_versions(
    store: CanaryStore, canary: Canary, versions: Mapping[tuple[str, str], str], now: int
) -> dict[tuple[str, str], tuple[str | None, str]]:
    """The new side's version of each shared class and level into the state; a change
    from the recorded one is a ``version`` event, from which the guard judges afresh.
    Returns each change: the version recorded before (None: a first sight, only
    recorded) and the new one."""
    shared = {(task_class, level) for task_class, level, _ in canary.partial()}
    changed = {
        key: version
        for key, version in versions.items()
        if key in shared and canary.state.of(*key).version != version
    }
    if changed:

        def change(state: CanaryState) -> CanaryState:
            for (task_class, level), version in changed.items():
                weight = percent(canary.weight(task_class, level))
                state = state.with_version(task_class, level, now, version, weight)
            return state

        store.change_state(change)
    return {key: (canary.state.of(*key).version, version) for key, version in changed.items()}

r"""Which side of a canary runs a task, and what its run's outcome becomes there.

A shared class's rows go to the new or the old side by the canary's hash (``Canary.takes``)
at each level; :func:`choose` picks the handler a task runs with, and who takes the row
should the new side fail it. A new-side run that fails, hands back or cannot finish
:func:`fallback`\ s: the row goes to the old side. The archive row names who ran it
(:func:`archive_owner`, :func:`implementation_label`), which the guard compares.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from bridge.canary.weights import FALLBACK, SCALE, Canary, labelled
from bridge.handlers.api import Handler
from bridge.handlers.capabilities import implementation_of
from bridge.handlers.outcome import HandlerResult
from bridge.handlers.registry import Registry
from bridge.queue import Outcome, Task
from bridge.queue.implementations import CELERY, PHD, PYTHON
from bridge.queue.model import MAX_NAME

log = logging.getLogger(__name__)

PHD_SHARE = "canary: phd's share"  # the reason a row the weights give to phd goes back
# What a new-side run falls back on: its failures, and a hand-back (its transport was down,
# or failed it mid-run), so that the row does not go back to the side that failed it.
FALLS_BACK = (Outcome.FAILURE, Outcome.PERMANENT_FAILURE, Outcome.HANDED_BACK)


def archive_owner(owner: str, implementation: str | None) -> str | None:
    """``owner`` with the implementation after its prefix (``bridge:native:pid:epoch:host:
    seq``), its host cut if the label would not fit in 64 characters; None (the owner
    unlabelled) when there is no label, or no room for one even without the host."""
    if implementation is None or ":" not in owner:
        return None
    archived = labelled(owner, implementation)
    over = len(archived) - MAX_NAME
    if over <= 0:
        return archived
    fields = archived.split(":")
    if len(fields) < 6 or len(fields[-2]) < over:  # prefix:label:pid:epoch:host:seq
        return None
    fields[-2] = fields[-2][: len(fields[-2]) - over]
    return ":".join(fields)


@dataclass(frozen=True)
class Choice:
    """Which handler runs a task under the canary in force. ``fallback_to``: set for a
    run of the new side of a class shared at some level (``phd`` at the celery level, the
    PHP transport at the python level), which takes the task when the run fails.
    ``back_to_phd``: the row is no longer the bridge's (its class was rolled back, or its
    weight lowered): it goes back, for phd. For a checked task (:func:`side_of`), who
    runs it as its archive row will say (``implementation``) and, for a new-side run,
    the task's age when a yield of it would be a yield loop (``yield_loop_age``)."""

    handler: Handler | None
    fallback_to: str | None = None
    back_to_phd: bool = False
    implementation: str = ""
    yield_loop_age: int | None = None


_UNHONOURED: set[str] = set()  # classes whose python weight this worker cannot honour


def choose(
    registry: Registry, canary: Canary, task_class: str, task_id: int, failure_time: int | None
) -> Choice:
    """The handler for a task (``failure_time`` as its row has it; None to predict a
    message's grouping before its check), by the registry and the new side test at each
    level (``Canary.takes``): at the celery level, a row that is phd's is handed back; at
    the python level, a natively served class runs natively only for the new side's share,
    else on the PHP transport the class would have without its native handler."""
    handler = registry.handler_for(task_class)
    if handler is None or not canary.active:
        return Choice(handler)  # no canary: not a cost a task pays
    fallback_to = None
    if canary.weight(task_class, CELERY) < SCALE:
        if not canary.takes(CELERY, task_class, task_id, failure_time):
            return Choice(None, back_to_phd=True)
        fallback_to = PHD
    if canary.weight(task_class, PYTHON) < SCALE and registry.native.get(task_class) is handler:
        php = registry.php_handler_for(task_class)
        if php is None:
            if task_class not in _UNHONOURED:
                _UNHONOURED.add(task_class)
                log.error(
                    "canary: %s has a python weight below 100 but no PHP path in this worker "
                    "(no runner glob, no Conduit): it runs natively here",
                    task_class,
                )
        elif canary.takes(PYTHON, task_class, task_id, failure_time):
            fallback_to = fallback_to or implementation_of(php)
        else:
            handler = php
    return Choice(handler, fallback_to)


def side_of(registry: Registry, canary: Canary, task: Task, max_yielding: int) -> Choice:
    """:func:`choose` for a checked task, by its row, with what its run needs to know of
    its side: who runs it (:func:`implementation_label`) and, on a new side, when its
    yield is a loop (:func:`yield_loop_age`, past ``max_yielding`` or its class's bound)."""
    choice = choose(registry, canary, task.task_class, task.id, task.failure_time)
    if choice.handler is None:
        return choice
    handler, fallback_to = choice.handler, choice.fallback_to
    looping = None if fallback_to is None else yield_loop_age(canary, task, max_yielding)
    return Choice(handler, fallback_to, False, implementation_label(handler, task), looping)


def implementation_label(handler: Handler, task: Task) -> str:
    """Who runs ``task``, as its archive row will say: the handler's implementation, with
    ``-fallback`` when the row fell back from a new side (``failureTime`` set, yet no
    failure counted)."""
    fell_back = task.failure_time is not None and task.failure_count == 0
    return implementation_of(handler) + (FALLBACK if fell_back else "")


def yield_loop_age(canary: Canary, task: Task, max_yielding: int) -> int | None:
    """``task``'s age (the database's clock) when it is past its class's
    ``max_yielding`` (its ``"guard"`` bound, else the setting's), else None: a yield is
    Phorge's "not yet" on either side, so only a new side that still yields a task that
    old is taken as looping (its yield then falls back); nothing in Phorge's tables
    counts a row's yields."""
    age = (task.server_time or task.date_created) - task.date_created
    bound = canary.configured(task.task_class).bound("max_yielding", max_yielding)
    return age if age > bound else None


def fallback(
    fallback_to: str | None, result: HandlerResult, yield_loop_age: int | None = None
) -> HandlerResult:
    """A new-side run's failure or hand-back (``fallback_to``: the old side, None for
    any other run), or its yield of a task ``yield_loop_age`` s old (set past the
    class's bound), as the fallback written instead (the row goes to the old side;
    nothing counted, nothing archived); any other result as it is."""
    looped = yield_loop_age is not None and result.outcome is Outcome.YIELD
    if fallback_to is None or not (looped or result.outcome in FALLS_BACK):
        return result
    taker = f"{fallback_to} takes it"
    if looped:
        taker = f"a yield loop (still yielding {yield_loop_age} s after its creation); {taker}"
    reason = f"{result.reason}; {taker}" if result.reason else taker
    return replace(
        result, outcome=Outcome.FALLBACK, reason=reason, delay=None, followups=(), scheduled=0
    )

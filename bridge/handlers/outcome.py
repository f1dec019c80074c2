"""Whether a handler's run may start, and how it ended, in the queue's vocabulary.

The runtime and the testing helper both clear a run and classify it here, so a handler
tested with ``bridge.handlers.testing`` ends exactly as it would under Celery. Nothing
is written and no metric is recorded: that is the runtime's part.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bridge.errors import HandBack, PermanentFailure, TemporaryFailure, Yield
from bridge.handlers.api import Handler, TaskContext, measured_duration, scheduled
from bridge.handlers.capabilities import BatchHandler
from bridge.queue.model import DEFAULT_RETRY_WAIT, MIN_YIELD_SECONDS, NewTask, Outcome

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HandlerResult:
    """One run's outcome and what the queue needs to record it.

    ``delay``: for YIELD the seconds the task is held back (those asked, at least
    Phorge's 5); for FAILURE the wait the handler declared (the exception's, else
    ``wait_before_retry``, else Phorge's 300 s for a handler with ``phorge_defaults``),
    None meaning the runtime's backoff, and negative ones kept, as in Phorge.
    ``duration_us`` is the run time the archive keeps: measured here, or where the work
    ran (PHP, for the Conduit proxy). ``error``: what a failed run raised, whose
    traceback the Celery state carries (Flower shows the handler's stack).
    ``required_lease``: the lease the handler required for the run (:func:`clear`),
    which a worker claims before it; the testing helper, with no lease to claim,
    reports it here.
    """

    outcome: Outcome
    delay: int | None = None
    reason: str = ""
    duration_us: int = 0
    followups: tuple[NewTask, ...] = ()
    error: Exception | None = field(default=None, compare=False, repr=False)
    required_lease: int | None = None
    scheduled: int = 0  # tasks the run scheduled itself (PHP's scheduleTask), besides

    @property
    def effects(self) -> int:
        """The tasks the run queued: its follow-ups and those it scheduled itself."""
        return len(self.followups) + self.scheduled


def policy(
    hook: Callable[[TaskContext], object], ctx: TaskContext, *, signed: bool = False
) -> int | None:
    """A handler's policy answer (seconds, or a count) as an int; None means the default.

    ``signed`` accepts negative answers (waits before retry, which Phorge allows).

    A hook that raises or answers nonsense must not stop the run from being reported:
    the failure would go uncounted and the task would loop, lease after lease, forever.
    """
    try:
        value: Any = hook(ctx)
        if value is None:
            return None
        if isinstance(value, bool) or (int(value) < 0 and not signed):
            raise ValueError(f"{value!r} is not a number of seconds or a count")
        return int(value)
    except Exception as exc:
        name = getattr(hook, "__name__", "policy")
        log.warning("%s#%d: %s: %s; using the default", ctx.task_class, ctx.id, name, exc)
        return None


@dataclass(frozen=True)
class Cleared:
    """A task cleared to run, and the seconds of lease its handler requires (None: the
    lease it holds will do)."""

    required_lease: int | None


def clear(handler: Handler, ctx: TaskContext) -> Cleared | HandlerResult:
    """Phorge's rules before a run (``executeTask``): a task that has failed more often
    than the handler's maximum retry count fails permanently, unrun; else it may run,
    under the lease the handler requires (set shorter or longer, as ``setLeaseDuration``
    sets it)."""
    limit = policy(handler.maximum_retry_count, ctx)
    if limit is not None and ctx.failure_count > limit:
        reason = f"{ctx.task_class}#{ctx.id} has exceeded the maximum number of failures ({limit})"
        return HandlerResult(Outcome.PERMANENT_FAILURE, reason=reason)
    return Cleared(policy(handler.required_lease, ctx))


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def run_handler(handler: Handler, ctx: TaskContext) -> HandlerResult:
    """Run the handler once and classify how it ended (Phorge's ``executeTask`` rules)."""
    started = time.perf_counter()
    try:
        handler.run(ctx)
        ended: Exception | None = None
    except Exception as exc:
        ended = exc
    return classify(handler, ctx, ended, int((time.perf_counter() - started) * 1_000_000))


def run_handlers(handler: BatchHandler, ctxs: Sequence[TaskContext]) -> list[HandlerResult]:
    """Run checked tasks with one ``run_batch`` call; each is classified as a run of its
    own, its duration PHP's measurement or else its share of the call."""
    started = time.perf_counter()
    ended = handler.run_batch(ctxs)
    if len(ended) != len(ctxs):
        raise RuntimeError(f"{handler.name}.run_batch answered {len(ended)} of {len(ctxs)} tasks")
    share_us = int((time.perf_counter() - started) * 1_000_000 / len(ctxs))
    return [classify(handler, ctx, exc, share_us) for ctx, exc in zip(ctxs, ended, strict=True)]


def classify(
    handler: Handler, ctx: TaskContext, ended: Exception | None, elapsed_us: int
) -> HandlerResult:
    """How a run that raised ``ended`` (None: returned) ended, in the queue's terms."""
    delay = None
    reason = "" if ended is None else _reason(ended)
    if ended is None:
        outcome = Outcome.SUCCESS
    elif isinstance(ended, Yield):
        # As executeTask's max($ex->getDuration(), 5): the wait reported is the one written.
        outcome, delay, reason = Outcome.YIELD, max(ended.delay, MIN_YIELD_SECONDS), ""
    elif isinstance(ended, HandBack):
        outcome = Outcome.HANDED_BACK
    elif isinstance(ended, PermanentFailure):
        outcome = Outcome.PERMANENT_FAILURE
    else:
        log.warning("%s#%d failed: %r", ctx.task_class, ctx.id, ended)
        delay = ended.delay if isinstance(ended, TemporaryFailure) else None
        if delay is None:
            delay = policy(handler.wait_before_retry, ctx, signed=True)
        if delay is None and handler.phorge_defaults:
            delay = DEFAULT_RETRY_WAIT
        outcome = Outcome.FAILURE
    duration_us = measured_duration(ctx)
    followups = ctx.followups if outcome is Outcome.SUCCESS else ()
    error = ended if outcome in (Outcome.FAILURE, Outcome.PERMANENT_FAILURE) else None
    return HandlerResult(
        outcome,
        delay,
        reason,
        elapsed_us if duration_us is None else duration_us,
        followups,
        error,
        scheduled=scheduled(ctx) if outcome is Outcome.SUCCESS else 0,
    )

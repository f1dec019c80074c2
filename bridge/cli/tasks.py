"""How ``list`` and ``show`` present a task: its state in an operator's words, when it is
due, why it last ended, and (``show``) its whole story.

Phorge has no status column: the queue layer reads a state off the row
(``bridge.queue.model.state_of``, which tells a retry wait or a yield that is over from
a lease a crash left behind, ``lease-expired``), and an archived row has a result code,
which the CLI names (success, failed, cancelled).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from bridge.cli.history import LogLine, last_outcomes
from bridge.queue import Outcome, Task
from bridge.queue.model import (
    RESULT_CANCELLED,
    RESULT_FAILURE,
    RESULT_SUCCESS,
    State,
)

RESULT_WORDS = {RESULT_SUCCESS: "success", RESULT_FAILURE: "failed", RESULT_CANCELLED: "cancelled"}
OUTCOME_WORDS = {
    RESULT_SUCCESS: "success",
    RESULT_FAILURE: "permanent failure (archived with result 1)",
    RESULT_CANCELLED: "cancelled by an operator (archived with result 2)",
}
DATA_PREVIEW = 200  # characters of a task's data that ``show`` prints

LastOutcomes = dict[int, tuple[Outcome, str]]


def server_now(task: Task) -> int:
    """The database clock when the row was read (the host's if unknown)."""
    return task.server_time if task.server_time is not None else int(time.time())


def _by_result(words: dict[int, str], task: Task, unknown: str) -> str:
    """The word for an archived row's result code (a code Phorge does not have: ``unknown``)."""
    return words.get(task.result, unknown) if task.result is not None else unknown


def state_word(task: Task) -> str:
    if task.archived:
        return _by_result(RESULT_WORDS, task, f"result-{task.result}")
    return task.state.value


def due(task: Task) -> int | None:
    """When the queue leases the task next (database clock); None while a worker holds
    it, and once it is archived."""
    if task.archived or task.state is State.LEASED:
        return None
    now = server_now(task)
    expires = task.lease_expires
    return expires if expires is not None and expires > now else now


def reason(task: Task, outcomes: LastOutcomes) -> str | None:
    """Why the task last ended other than in success: its latest outcome in the logs, or
    the bridge's verdict on its data (a corrupt data row fails it permanently)."""
    outcome = outcomes.get(task.id)
    if outcome is not None and outcome[0] is not Outcome.SUCCESS:
        word, text = outcome
        return f"{word.value}: {text}" if text else word.value
    return task.data_error


def data_bytes(task: Task) -> int | None:
    """The size of the task's data row (None when missing or not UTF-8)."""
    return None if task.raw_data is None else len(task.raw_data.encode("utf-8"))


def span(seconds: int) -> str:
    """A duration as an operator reads it: 45 s, 4 min 10 s, 3 h 5 min, 2 d 3 h."""
    for unit, size, smaller, smaller_size in (
        ("d", 86400, "h", 3600),
        ("h", 3600, "min", 60),
        ("min", 60, "s", 1),
    ):
        if seconds >= size:
            rest = (seconds % size) // smaller_size
            return f"{seconds // size} {unit}" + (f" {rest} {smaller}" if rest else "")
    return f"{seconds} s"


def due_text(task: Task) -> str:
    when = due(task)
    if when is None:
        return "-"
    wait = when - server_now(task)
    return f"in {span(wait)}" if wait > 0 else "now"


def stamp(epoch: int | None, now: int) -> str:
    """An epoch as UTC, with how long ago or ahead it is ("-" for none, or Phorge's 0)."""
    if not epoch:
        return "-"
    utc = datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    offset = epoch - now
    relative = (
        "now" if offset == 0 else f"in {span(offset)}" if offset > 0 else f"{span(-offset)} ago"
    )
    return f"{utc} ({relative})"


def lease_text(task: Task, now: int) -> str:
    """When the lease runs out; an archived row keeps its last lease's columns, but that
    lease ended with its run: no worker holds it."""
    if task.archived:
        return "none (archived: the last run's lease ended with it)"
    return stamp(task.lease_expires, now)


def task_json(task: Task, outcomes: LastOutcomes) -> dict[str, Any]:
    """The row as ``list --json`` prints it: every column, and the CLI's reading of it."""
    row = asdict(task)
    row.pop("raw_data")
    row.update(state=state_word(task), due=due(task), reason=reason(task, outcomes))
    return row


LIST_HEADER = f"{'TASK':<40} {'STATE':<17} {'PRIORITY':>8} {'FAILURES':>8}  {'DUE':<14} REASON"


def list_line(task: Task, outcomes: LastOutcomes) -> str:
    return (
        f"{task.label:<40} {state_word(task):<17} {task.priority:>8} {task.failure_count:>8}  "
        f"{due_text(task):<14} {reason(task, outcomes) or ''}".rstrip()
    )


def outcome_text(task: Task) -> str | None:
    """How the task ended, once archived."""
    if not task.archived:
        return None
    words = _by_result(OUTCOME_WORDS, task, f"result {task.result}")
    if task.result == RESULT_SUCCESS and task.duration is not None:
        words += f" in {task.duration / 1000:.1f} ms"
    return words


def runs(lines: list[LogLine]) -> list[dict[str, Any]]:
    """The task's lines grouped by run (each lease has its own owner), in order."""
    by_owner: dict[str, dict[str, Any]] = {}
    for line in lines:
        run = by_owner.setdefault(
            line.owner,
            {"owner": line.owner, "traceparent": line.traceparent, "outcome": None, "lines": []},
        )
        run["lines"].append(line.text)
        if line.outcome is not None:
            outcome, text = line.outcome
            run["outcome"] = f"{outcome.value}: {text}" if text else outcome.value
    return list(by_owner.values())


def story(task: Task, lines: Iterable[LogLine]) -> dict[str, Any]:
    """Everything ``show`` knows of one task: the row, its data, its outcome, its runs."""
    mine = [line for line in lines if line.task_id == task.id]
    return {
        **task_json(task, last_outcomes(mine)),
        "table": "worker_archivetask" if task.archived else "worker_activetask",
        "data_bytes": data_bytes(task),
        "outcome": outcome_text(task),
        "runs": runs(mine),
    }


def _data_text(task: Task, size: int | None) -> str:
    if size is None:
        return f"unreadable ({task.data_error})"
    shown = json.dumps(task.data)
    preview = shown if len(shown) <= DATA_PREVIEW else shown[:DATA_PREVIEW] + "..."
    return f"{size} bytes (worker_taskdata {task.data_id}): {preview}"


def story_lines(task: Task, told: dict[str, Any], logs_read: bool) -> list[str]:
    """``show``'s text: one field a line, then the runs the logs tell of."""
    now = server_now(task)
    fields = [
        ("state", told["state"]),
        ("outcome", told["outcome"] or "none yet (still active)"),
        ("due", due_text(task)),
        ("reason", told["reason"] or "-"),
        ("table", told["table"]),
        ("priority", str(task.priority)),
        ("failures", str(task.failure_count)),
        ("last failure", stamp(task.failure_time, now)),
        ("lease owner", task.lease_owner or "-"),
        ("lease expires", lease_text(task, now)),
        ("created", stamp(task.date_created, now)),
        ("modified", stamp(task.date_modified, now)),
        ("archived", stamp(task.archived_epoch, now)),
        ("object", task.object_phid or "-"),
        ("container", task.container_phid or "-"),
        ("data", _data_text(task, told["data_bytes"])),
    ]
    text = [f"{task.label}: {told['state']}"]
    text += [f"  {name:<14} {value}" for name, value in fields]
    if not logs_read:
        text.append("history: give the worker logs with --log FILE")
        return text
    text.append(f"history: {len(told['runs'])} run(s) in the logs")
    for number, run in enumerate(told["runs"], 1):
        ended = run["outcome"] or "no outcome logged"
        text.append(f"  run {number}: owner {run['owner']}, {ended}")
        text.append(f"    traceparent {run['traceparent']}")
        text += [f"    | {line}" for line in run["lines"]]
    return text

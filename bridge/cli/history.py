"""A task's history, read back from the bridge's logs.

Phorge's tables keep no history and no failure reason; the bridge's log lines do. Every
line written about a task ends with its tag (``bridge.engine.tracing.TaskTrace.tag``:
``[task=ID class=CLASS owner=OWNER traceparent=...]``), and each run's last line is its
outcome (``bridge.engine.reports.RunReport.describe``: ``Class#ID [IMPLEMENTATION]: OUTCOME[:
reason][ (due again in N s)]``, without the implementation when no handler was chosen).
The tag is matched whole, so task 12 never picks up task 120's lines. Celery's own line
about the run quotes the outcome (``raised expected: TaskFailed('Class#ID ...')``): the
label must follow a space or start the line, so only the bridge's line counts, never the
quote (whose reason would end in ``')``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from bridge.queue import Outcome

TAG = re.compile(
    r"\[task=(?P<id>\d+) class=\S+ owner=(?P<owner>\S+) traceparent=(?P<traceparent>[0-9a-f-]+)\]"
)
_OUTCOMES = "|".join(re.escape(outcome.value) for outcome in Outcome)
OUTCOME = re.compile(
    rf"(?<!\S)[\w\\]*#(?P<id>\d+)(?: \[[\w-]+\])?: (?P<outcome>{_OUTCOMES})(?:: (?P<reason>.*?))?"
    rf"(?: \(due again in -?\d+ s\))? \[task=(?P=id) "
)


@dataclass(frozen=True)
class LogLine:
    """One log line about a task, with the run (lease owner, trace) it belongs to."""

    task_id: int
    owner: str
    traceparent: str
    text: str

    @property
    def outcome(self) -> tuple[Outcome, str] | None:
        """The run's outcome and reason when this is its outcome line."""
        found = OUTCOME.search(self.text)
        if found is None:
            return None
        return Outcome(found["outcome"]), found["reason"] or ""


def read_lines(paths: Iterable[Path], task_ids: Collection[int] | None = None) -> Iterator[LogLine]:
    """The tagged lines of the logs at ``paths``, in order; only ``task_ids``' if given."""
    for path in paths:
        with path.open(encoding="utf-8", errors="replace") as log:
            for text in log:
                if "[task=" not in text:
                    continue
                tag = TAG.search(text)
                if tag is None:
                    continue
                task_id = int(tag["id"])
                if task_ids is None or task_id in task_ids:
                    yield LogLine(task_id, tag["owner"], tag["traceparent"], text.rstrip("\n"))


def last_outcomes(lines: Iterable[LogLine]) -> dict[int, tuple[Outcome, str]]:
    """Each task's latest outcome in ``lines``, with its reason."""
    latest: dict[int, tuple[Outcome, str]] = {}
    for line in lines:
        outcome = line.outcome
        if outcome is not None:
            latest[line.task_id] = outcome
    return latest

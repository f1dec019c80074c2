"""Many tasks at once: enqueue from JSON lines, and one summary for an action on many rows.

An action on a class can touch thousands of rows; a line each would bury what matters,
so the summary counts the rows by result and names a few of each (``--verbose`` keeps a
line per row).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from bridge.queue import NewTask
from bridge.queue.model import ActionResult

TASK_FIELDS = frozenset(f.name for f in fields(NewTask))
NAMED_PER_REASON = 3  # rows the summary names for each reason
# The queue's reasons name its keyword arguments; a CLI user types the options.
_API_WORDS = re.compile(r"\buse (repeat|retry)\b")


def new_task(line: str, defaults: dict[str, Any]) -> NewTask:
    """One JSON line as a task, ``defaults`` (the command's options) under its fields."""
    given = json.loads(line)
    if not isinstance(given, dict):
        raise ValueError(f"expected a JSON object, got {type(given).__name__}")
    unknown = sorted(set(given) - TASK_FIELDS)
    if unknown:
        raise ValueError(
            f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(TASK_FIELDS))}"
        )
    if "task_class" not in given:
        raise ValueError("task_class is missing")
    task = NewTask(**{**defaults, **given})
    task.validated()
    return task


def read_tasks(lines: Iterable[str], defaults: dict[str, Any]) -> list[NewTask]:
    """Every non-blank line as a task; a bad one raises ValueError naming its line number."""
    tasks = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            tasks.append(new_task(line, defaults))
        except ValueError as exc:
            raise ValueError(f"line {number}: {exc}") from None
    return tasks


def cli_words(reason: str) -> str:
    return _API_WORDS.sub(r"use --\1", reason)


def named(labels: list[str]) -> str:
    shown = ", ".join(labels[:NAMED_PER_REASON])
    more = len(labels) - NAMED_PER_REASON
    return f"{shown} and {more} more" if more > 0 else shown


def summary(results: list[ActionResult], verb: str) -> list[str]:
    """The counts by result: how many were ``verb``, then each refusal with a few rows."""
    refused: dict[str, list[str]] = {}
    for result in results:
        if not result.done:
            refused.setdefault(cli_words(result.reason), []).append(result.label)
    lines = [f"{sum(r.done for r in results)} task(s) {verb}."]
    lines += [
        f"{len(labels)} task(s) not {verb}: {why} ({named(labels)})"
        for why, labels in refused.items()
    ]
    return lines


def per_row(results: list[ActionResult], verb: str) -> list[str]:
    return [f"{r.label}: {verb if r.done else cli_words(r.reason)}" for r in results]

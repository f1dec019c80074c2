"""``phorge-bridge``: the operator's command line (demo, settings, doctor, bin/worker's actions).

Workers and beat are Celery's own commands: ``celery -A bridge worker`` and
``celery -A bridge beat``. Help texts are plain text (click prints docstrings as they
are): no reStructuredText in a command's docstring.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from pathlib import Path
from typing import IO, Any, TypeVar

import click

from bridge._version import __version__
from bridge.assembly import build_registry, build_runtime
from bridge.cli import bulk, history, tasks
from bridge.cli import demo as embedded
from bridge.cli import doctor as checks
from bridge.cli.canary import canary
from bridge.cli.execute import execute_tasks as run_selected
from bridge.cli.service_errors import ServiceErrorsGroup, broker_problem
from bridge.cli.watch import watch
from bridge.config import SETTINGS, ConfigError, Settings, explain, load_settings
from bridge.engine.tracing import tag_log_lines
from bridge.phorge import extension as phorge_extension
from bridge.queue import OperatorActions, PhorgeQueue
from bridge.queue.model import ActionResult, QueueStats, TaskFilter

F = TypeVar("F", bound=Callable[..., Any])
LIST_LIMIT = 50  # rows ``list`` prints unless told otherwise


def settings_or_exit() -> Settings:
    try:
        return load_settings()
    except ConfigError as exc:
        raise click.ClickException(f"configuration error: {exc}") from None


def open_queue() -> PhorgeQueue:
    return PhorgeQueue.from_url(settings_or_exit().database_url)


@click.group(cls=ServiceErrorsGroup)
@click.version_option(__version__, prog_name="phorge-bridge")
def main() -> None:
    """Run Phorge's task queue on Celery; operate it like bin/worker.

    A database or broker error ends any command with one line naming the setting
    (BRIDGE_DATABASE_URL, BRIDGE_BROKER_URL) and exit status 1. Shell completion:
    eval "$(_PHORGE_BRIDGE_COMPLETE=bash_source phorge-bridge)" (zsh_source, fish_source).
    """


@main.command()
@click.option(
    "--dir",
    "directory",
    type=click.Path(path_type=Path),
    default=Path(".bridge-demo"),
    show_default=True,
    help="Where the demo keeps its SQLite files and log.",
)
@click.option("--timeout", default=90.0, show_default=True, help="Seconds to wait for the tasks.")
def demo(directory: Path, timeout: float) -> None:
    """Run the bridge on an embedded default (SQLite + server-less broker) with sample tasks."""

    if not embedded.run(directory.resolve(), timeout, click.echo):
        raise click.ClickException("not every sample task was archived in time; see the log")


def settings_in_force() -> dict[str, dict[str, Any]]:
    """Each setting's value here, secrets and URLs with credentials hidden."""
    shown = {}
    for setting in SETTINGS:
        value = os.environ.get(setting.name)
        if value and (setting.secret or ("@" in value and "://" in value)):
            value = "(set, hidden)"
        shown[setting.name] = {
            "value": setting.default if value is None else value,
            "default": value is None,
        }
    return shown


@main.command("settings")
@click.option(
    "--table", is_flag=True, help="Print the table of settings (docs/settings.md) instead."
)
@click.option(
    "--json", "as_json", is_flag=True, help='One JSON object: {NAME: {"value", "default"}}.'
)
def show_settings(table: bool, as_json: bool) -> None:
    """Print every BRIDGE_* setting with its value here (secrets hidden), or the error."""

    if table:
        click.echo(explain())
        return
    settings_or_exit()
    shown = settings_in_force()
    if as_json:
        click.echo(json.dumps(shown))
        return
    for name, value in shown.items():
        click.echo(f"{name}={value['value']}" + (" (default)" if value["default"] else ""))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object with every check.")
def doctor(as_json: bool) -> None:
    """Check settings, database, tables, broker, Conduit, the extension, PHP taskmasters
    and clocks; exit 1 when any check fails."""

    results = checks.diagnose()
    click.echo(checks.render(results, as_json))
    if any(result.status == "fail" for result in results):
        sys.exit(1)


@main.command()
@click.option(
    "--liveness-file",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="The file a worker started with --liveness-file refreshes.",
)
@click.option(
    "--max-age",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds without consumption after which the worker counts as dead.",
)
def health(liveness_file: Path, max_age: float) -> None:
    """Exit 1 unless the worker consumed its own broker heartbeat within --max-age."""
    from bridge.runtime.liveness import staleness

    problem = staleness(liveness_file, max_age)
    if problem:
        raise click.ClickException(problem)
    click.echo("ok: consuming")


def selector_options(limit: int | None = None) -> Callable[[F], F]:
    """bin/worker's task selectors; ``limit`` is --limit's default."""
    options = [
        click.option("--id", "ids", type=int, multiple=True, help="Task id (repeatable)."),
        click.option("--class", "classes", multiple=True, help="Task class (repeatable)."),
        click.option("--active", is_flag=True, help="Only active tasks."),
        click.option("--archived", is_flag=True, help="Only archived tasks."),
        click.option("--container", "containers", multiple=True, help="Container PHID."),
        click.option("--object", "objects", multiple=True, help="Object PHID."),
        click.option("--min-failure-count", type=int, help="Only tasks failed at least N times."),
        click.option("--max-failure-count", type=int, help="Only tasks failed at most N times."),
        click.option("--min-priority", type=int, help="Only tasks with at least this priority."),
        click.option("--max-priority", type=int, help="Only tasks with at most this priority."),
        click.option(
            "--limit",
            type=int,
            default=limit,
            show_default=limit is not None,
            help="At most this many tasks, newest first.",
        ),
    ]

    def decorate(command: F) -> F:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def make_filter(options: dict[str, Any]) -> TaskFilter:
    try:
        return TaskFilter(
            ids=options.pop("ids") or None,
            classes=options.pop("classes") or None,
            active=options.pop("active"),
            archived=options.pop("archived"),
            container_phids=options.pop("containers") or None,
            object_phids=options.pop("objects") or None,
            min_failure_count=options.pop("min_failure_count"),
            max_failure_count=options.pop("max_failure_count"),
            min_priority=options.pop("min_priority"),
            max_priority=options.pop("max_priority"),
            limit=options.pop("limit"),
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def enqueue_jsonl(jsonl: IO[str], defaults: dict[str, Any]) -> list[int]:
    """Queue every line's task in one transaction: all of them, or none."""
    try:
        return open_queue().enqueue_many(bulk.read_tasks(jsonl, defaults))
    except ValueError as exc:
        raise click.UsageError(f"--jsonl: {exc}") from None


def enqueue_one(task_class: str, data: str, options: dict[str, Any]) -> int:
    try:
        payload = json.loads(data)
    except ValueError as exc:
        raise click.UsageError(f"DATA is not valid JSON: {exc}") from None
    try:
        return open_queue().enqueue(task_class, payload, **options)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


@main.command("enqueue")
@click.argument("task_class", required=False)
@click.argument("data", default="null")
@click.option(
    "--jsonl",
    type=click.File("r"),
    help="Queue one task per line of this file (- for standard input) instead: a JSON "
    "object with task_class and any of data, priority, delay_until, object_phid, "
    "container_phid.",
)
@click.option("--priority", type=int, help="Smaller runs first (default 2000).")
@click.option("--delay-until", type=int, help="Epoch before which the task does not run.")
@click.option("--object", "object_phid", help="Object PHID.")
@click.option("--container", "container_phid", help="Container PHID.")
def enqueue_task(task_class: str | None, data: str, jsonl: IO[str] | None, **options: Any) -> None:
    """Queue TASK_CLASS with the JSON payload DATA, or every task of --jsonl; print each id.

    With --jsonl, every line is checked before anything is written, and all the tasks
    are queued in one transaction; the other options are defaults for the lines.
    """
    if task_class is not None and jsonl is None:
        ids = [enqueue_one(task_class, data, options)]
    elif jsonl is not None and task_class is None:
        ids = enqueue_jsonl(jsonl, {name: v for name, v in options.items() if v is not None})
    else:
        raise click.UsageError("give either TASK_CLASS [DATA] or --jsonl FILE")
    for task_id in ids:
        click.echo(task_id)


def log_option(command: F) -> F:
    return click.option(
        "--log",
        "logs",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        multiple=True,
        help="A worker's log file (repeatable): the tasks' runs and last reasons come "
        "from its lines.",
    )(command)


def log_lines(logs: Iterable[Path], task_ids: Iterable[int]) -> list[history.LogLine]:
    return list(history.read_lines(logs, set(task_ids))) if logs else []


@main.command("list")
@selector_options(limit=LIST_LIMIT)
@log_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def list_tasks(as_json: bool, logs: tuple[Path, ...], **options: Any) -> None:
    """List tasks, active then archived, newest first: state (an archived task's
    result), priority, failures, when it is due and why it last did not succeed.

    A note on standard error says when more tasks match than --limit shows.
    """
    selector = make_filter(options)
    limit = selector.limit
    found = open_queue().list(replace(selector, limit=None if limit is None else limit + 1))
    shown = found[:limit]
    outcomes = history.last_outcomes(log_lines(logs, (t.id for t in shown)))
    if not as_json:
        click.echo(tasks.LIST_HEADER)
    for task in shown:
        if as_json:
            click.echo(json.dumps(tasks.task_json(task, outcomes)))
        else:
            click.echo(tasks.list_line(task, outcomes))
    if len(found) > len(shown):
        click.echo(
            f"more tasks match than --limit {limit} shows; raise it, or narrow the selection",
            err=True,
        )


@main.command()
@click.option("--id", "task_id", type=int, required=True, help="The task's id.")
@log_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def show(task_id: int, logs: tuple[Path, ...], as_json: bool) -> None:
    """Print one task's whole story: its row (active or archived), its data, its outcome
    and, from the worker logs given with --log, each run and how it ended."""
    task = open_queue().get(task_id)
    if task is None:
        raise click.ClickException(
            f"no task with id {task_id} (Phorge deletes archived tasks after 14 days)"
        )
    told = tasks.story(task, log_lines(logs, [task_id]))
    if as_json:
        click.echo(json.dumps(told))
        return
    click.echo("\n".join(tasks.story_lines(task, told, bool(logs))))


@main.command()
@click.option(
    "--json", "as_json", is_flag=True, help="One JSON object (with --watch, a line each)."
)
@click.option("--window", default=3600, show_default=True, help="Seconds of archive to count.")
@click.option(
    "--watch",
    "watching",
    is_flag=True,
    help="Refresh a line every --interval seconds while a backlog drains: its size, the "
    "drain rate and an ETA. Ctrl-C stops it.",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="Seconds between two --watch refreshes.",
)
@click.option("--count", type=click.IntRange(min=1), help="Stop --watch after this many refreshes.")
def stats(as_json: bool, window: int, watching: bool, interval: float, count: int | None) -> None:
    """Queue depth per class and state, as the database sees it, whether a beat sends
    the polls (doctor's beat check), and each Celery queue's due rows and live consumers
    (Celery's control API).

    Exits 1, after printing what the database says, when the broker is unreachable.
    """
    if watching:
        queue = open_queue()
        watch(lambda: queue.stats(window), interval, count, as_json, click.echo)
        return
    settings = settings_or_exit()  # before the Celery app, which would raise on a bad one
    from kombu.exceptions import OperationalError

    from bridge.celery import app
    from bridge.runtime.consumers import describe, survey

    queue = open_queue()
    result = queue.stats(window)
    beat = checks.beat_state(queue.engine, settings.owner_prefix)
    try:
        queues = survey(app, result, build_registry(settings), settings)
    except OperationalError as exc:
        queues, unreachable = [], f"queue consumers unknown: {broker_problem(exc)}"
    else:
        unreachable = ""
    if as_json:
        beat_json = {"status": beat.status, "detail": beat.detail}
        queues_json = [asdict(q) for q in queues]
        click.echo(json.dumps({**asdict(result), "beat": beat_json, "queues": queues_json}))
    else:
        lines = [f"queue {describe(status, settings.control_queue)}" for status in queues]
        print_stats(result, [f"beat: {beat.detail}", *lines])
    if unreachable:
        raise click.ClickException(unreachable)


def print_stats(result: QueueStats, lines: list[str]) -> None:
    for task_class, states in sorted(result.by_class.items()):
        counts = ", ".join(f"{state} {count}" for state, count in sorted(states.items()))
        click.echo(f"{task_class}: {counts}")
    if result.oldest_queued_age is not None:
        click.echo(f"oldest queued task: {result.oldest_queued_age} s")
    for line in lines:
        click.echo(line)


def report(results: list[ActionResult], verb: str, verbose: bool) -> None:
    lines = bulk.per_row(results, verb) if verbose else []
    click.echo("\n".join(lines + bulk.summary(results, verb)))


verbose_option = click.option(
    "--verbose", "-v", is_flag=True, help="A line for each task, before the summary."
)


def operator_action(
    name: str, verb: str, act: Callable[..., list[ActionResult]]
) -> Callable[..., None]:
    """A bin/worker-style command: selectors pick the tasks, ``act`` changes them, and a
    summary counts the tasks by result."""

    def command(verbose: bool, **options: Any) -> None:
        selector = make_filter(options)
        if not selector.constrained:
            raise click.UsageError("select tasks with --id, --class, ... (see --help)")
        try:
            results = act(OperatorActions(open_queue()), selector, **options)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        report(results, verb, verbose)

    command.__name__ = name
    return selector_options()(verbose_option(command))


main.command(
    "cancel", help="Archive the selected active tasks as cancelled (result 2), breaking any lease."
)(operator_action("cancel", "cancelled", OperatorActions.cancel))
main.command(
    "free", help="Break the leases of the selected active tasks, so they can be leased again."
)(operator_action("free", "freed", OperatorActions.free))
main.command(
    "retry",
    help="Queue the selected archived tasks again under their own ids; a task that "
    "succeeded only with --repeat.",
)(
    click.option("--repeat", is_flag=True, help="Also repeat tasks that succeeded.")(
        operator_action("retry", "queued for retry", OperatorActions.retry)
    )
)
main.command(
    "delay", help="Hold the selected active, unleased tasks back until the epoch --until."
)(
    click.option("--until", type=int, required=True, help="Epoch to hold the tasks until.")(
        operator_action("delay", "delayed", OperatorActions.delay)
    )
)
main.command(
    "priority",
    help="Give the selected active tasks the priority --priority (smaller runs first).",
)(
    click.option("--priority", type=int, required=True, help="New priority (positive).")(
        operator_action("priority", "reprioritized", OperatorActions.set_priority)
    )
)


@main.command("execute")
@click.option("--retry", is_flag=True, help="Also execute archived tasks (unarchived first).")
@click.option("--repeat", is_flag=True, help="With --retry, also tasks that succeeded.")
@selector_options()
def execute_tasks(retry: bool, repeat: bool, **options: Any) -> None:
    """Run the selected tasks now, in this process, as a worker would; one line per task.

    Exits 1 unless every task it ran succeeded (bin/worker execute).
    """

    selector = make_filter(options)
    if not selector.constrained:
        raise click.UsageError("select tasks with --id, --class, ... (see --help)")
    rt = build_runtime(settings_or_exit())
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tag_log_lines()
    try:
        all_succeeded = run_selected(rt, selector, retry, repeat, click.echo)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if not all_succeeded:
        sys.exit(1)


@main.command()
@click.argument("task_ids", metavar="[IDS]...", type=int, nargs=-1)
@selector_options()
def awaken(task_ids: tuple[int, ...], **options: Any) -> None:
    """Bring the selected yielded tasks forward, so they run now: IDS, or the tasks the
    options select. Like Phorge, only tasks that never failed are awakened."""
    options["ids"] += task_ids
    selector = make_filter(options)
    if not selector.constrained:
        raise click.UsageError("give task IDS, or select tasks with --id, --class, ...")
    queue = open_queue()
    active = [task.id for task in queue.list(selector) if not task.archived]
    awakened = OperatorActions(queue).awaken(active)
    click.echo(f"{awakened} task(s) awakened.")
    if len(active) > awakened:
        click.echo(f"{len(active) - awakened} task(s) not awakened: not yielded, or failed before")


@main.command("create-tables")
def create_tables() -> None:
    """Create Phorge's queue tables in an empty SQLite database (never needed on Phorge's)."""
    queue = open_queue()
    if queue.engine.dialect.name != "sqlite":
        raise click.ClickException("refusing: Phorge's own `bin/storage upgrade` owns MySQL tables")
    queue.create_tables()
    click.echo("tables ready")


@main.group()
def phorge() -> None:
    """Manage the Conduit extension shipped to Phorge."""


@phorge.command("install-extension")
@click.option(
    "--phorge-root",
    type=click.Path(path_type=Path, file_okay=False),
    required=True,
    help="Phorge's checkout (the directory holding bin/ and src/).",
)
@click.option("--check", is_flag=True, help="Only report whether the installed copy is current.")
def install_extension(phorge_root: Path, check: bool) -> None:
    """Copy the worker.execute Conduit method into PHORGE_ROOT/src/extensions/."""

    try:
        if check:
            status = phorge_extension.check(phorge_root)
            click.echo(status.describe())
            sys.exit(0 if status else 1)
        click.echo(f"installed {phorge_extension.install(phorge_root)}")
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


main.add_command(canary)

if __name__ == "__main__":
    main()

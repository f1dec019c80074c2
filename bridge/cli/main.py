"""``phorge-bridge``: the operator's command line (demo, settings, doctor, bin/worker's actions).

Workers and beat are Celery's own commands: ``celery -A bridge worker`` and
``celery -A bridge beat``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import click

from bridge._version import __version__
from bridge.cli import demo as embedded
from bridge.cli import doctor as checks
from bridge.cli.execute import execute_tasks as run_selected
from bridge.config import SETTINGS, ConfigError, Settings, explain, load_settings
from bridge.engine.context import build_runtime
from bridge.engine.tracing import tag_log_lines
from bridge.handlers.registry import build_registry
from bridge.phorge import extension as phorge_extension
from bridge.queue import OperatorActions, PhorgeQueue
from bridge.queue.model import ActionResult, Task, TaskFilter

F = TypeVar("F", bound=Callable[..., Any])


def settings_or_exit() -> Settings:
    try:
        return load_settings()
    except ConfigError as exc:
        raise click.ClickException(f"configuration error: {exc}") from None


def open_queue() -> PhorgeQueue:
    return PhorgeQueue.from_url(settings_or_exit().database_url)


@click.group()
@click.version_option(__version__, prog_name="phorge-bridge")
def main() -> None:
    """Run Phorge's task queue on Celery; operate it like bin/worker.

    The commands that talk to Celery import it (and its app, which reads every
    BRIDGE_* setting as it is built) only once their settings are checked.
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


@main.command("settings")
@click.option("--table", is_flag=True, help="Print the README's table of settings instead.")
def show_settings(table: bool) -> None:
    """Print every BRIDGE_* setting with its value here (secrets hidden), or the error."""

    if table:
        click.echo(explain())
        return
    settings_or_exit()
    for setting in SETTINGS:
        value = os.environ.get(setting.name)
        if value and (setting.secret or ("@" in value and "://" in value)):
            value = "(set, hidden)"
        shown = value if value is not None else f"{setting.default} (default)"
        click.echo(f"{setting.name}={shown}")


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


def selector_options(command: F) -> F:
    """bin/worker's task selectors."""
    options = [
        click.option("--id", "ids", type=int, multiple=True, help="Task id (repeatable)."),
        click.option("--class", "classes", multiple=True, help="Task class (repeatable)."),
        click.option("--active", is_flag=True, help="Only active tasks."),
        click.option("--archived", is_flag=True, help="Only archived tasks."),
        click.option("--container", "containers", multiple=True, help="Container PHID."),
        click.option("--object", "objects", multiple=True, help="Object PHID."),
        click.option("--min-failure-count", type=int),
        click.option("--max-failure-count", type=int),
        click.option("--min-priority", type=int),
        click.option("--max-priority", type=int),
        click.option("--limit", type=int),
    ]
    for option in reversed(options):
        command = option(command)
    return command


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


def task_row(task: Task) -> dict[str, Any]:
    row = asdict(task)
    row["state"] = task.state.value
    row.pop("raw_data")
    return row


@main.command("enqueue")
@click.argument("task_class")
@click.argument("data", default="null")
@click.option("--priority", type=int, help="Smaller runs first (default 2000).")
@click.option("--delay-until", type=int, help="Epoch before which the task does not run.")
@click.option("--object", "object_phid")
@click.option("--container", "container_phid")
def enqueue_task(task_class: str, data: str, **options: Any) -> None:
    """Queue a task; DATA is its JSON payload."""
    try:
        payload = json.loads(data)
    except ValueError as exc:
        raise click.UsageError(f"DATA is not valid JSON: {exc}") from None
    try:
        task_id = open_queue().enqueue(task_class, payload, **options)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(task_id)


@main.command("list")
@selector_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def list_tasks(as_json: bool, **options: Any) -> None:
    """List tasks, active then archived, newest first."""
    for task in open_queue().list(make_filter(options)):
        if as_json:
            click.echo(json.dumps(task_row(task)))
        else:
            click.echo(
                f"{task.label:<40} {task.state.value:<17} priority {task.priority:<5} "
                f"failures {task.failure_count}"
            )


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--window", default=3600, show_default=True, help="Seconds of archive to count.")
def stats(as_json: bool, window: int) -> None:
    """Queue depth per class and state, as the database sees it, and each Celery queue's
    due rows and live consumers (Celery's control API)."""
    settings = settings_or_exit()  # before the Celery app, which would raise on a bad one
    from kombu.exceptions import OperationalError

    from bridge.celery import app
    from bridge.runtime.consumers import describe, survey

    result = open_queue().stats(window)
    try:
        queues = survey(app, result, build_registry(settings), settings)
    except OperationalError as exc:
        queues, unreachable = [], f"queue consumers: unknown, the broker is unreachable: {exc}"
    else:
        unreachable = ""
    if as_json:
        click.echo(json.dumps({**asdict(result), "queues": [asdict(q) for q in queues]}))
        return
    for task_class, states in sorted(result.by_class.items()):
        counts = ", ".join(f"{state} {count}" for state, count in sorted(states.items()))
        click.echo(f"{task_class}: {counts}")
    if result.oldest_queued_age is not None:
        click.echo(f"oldest queued task: {result.oldest_queued_age} s")
    for status in queues:
        click.echo(f"queue {describe(status)}")
    if unreachable:
        click.echo(unreachable)


def report(results: list[ActionResult], verb: str) -> None:
    for result in results:
        click.echo(f"{result.label}: {verb}" if result.done else f"{result.label}: {result.reason}")
    click.echo(f"{sum(r.done for r in results)} task(s) {verb}.")


def operator_action(
    name: str, verb: str, act: Callable[..., list[ActionResult]]
) -> Callable[..., None]:
    """A bin/worker-style command: selectors pick the tasks, ``act`` changes them."""

    def command(**options: Any) -> None:
        selector = make_filter(options)
        if not selector.constrained:
            raise click.UsageError("select tasks with --id, --class, ... (see --help)")
        try:
            report(act(OperatorActions(open_queue()), selector, **options), verb)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None

    command.__name__ = name
    command.__doc__ = act.__doc__
    return selector_options(command)


main.command("cancel")(operator_action("cancel", "cancelled", OperatorActions.cancel))
main.command("free")(operator_action("free", "freed", OperatorActions.free))
main.command("retry")(
    click.option("--repeat", is_flag=True, help="Also repeat tasks that succeeded.")(
        operator_action("retry", "queued for retry", OperatorActions.retry)
    )
)
main.command("delay")(
    click.option("--until", type=int, required=True, help="Epoch to hold the tasks until.")(
        operator_action("delay", "delayed", OperatorActions.delay)
    )
)
main.command("priority")(
    click.option("--priority", type=int, required=True, help="New priority (positive).")(
        operator_action("priority", "reprioritized", OperatorActions.set_priority)
    )
)


@main.command("execute")
@click.option("--retry", is_flag=True, help="Also execute archived tasks (unarchived first).")
@click.option("--repeat", is_flag=True, help="With --retry, also tasks that succeeded.")
@selector_options
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
@click.argument("ids", type=int, nargs=-1, required=True)
def awaken(ids: tuple[int, ...]) -> None:
    """Bring yielded, never-failed tasks forward."""
    click.echo(f"{OperatorActions(open_queue()).awaken(ids)} task(s) awakened.")


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
@click.option("--phorge-root", type=click.Path(path_type=Path, file_okay=False), required=True)
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


if __name__ == "__main__":
    main()

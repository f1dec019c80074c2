"""``phorge-bridge canary``: the canary's weights, rollbacks and figures.

The operator sets the weights with Phorge's ``./bin/config set --database
phorge-bridge.canary '<json>'`` or, one class and level at a time, ``canary set`` and
``unset``; these verbs show them, roll a class back or promote it, pause or resume its
ramp (``phorge-bridge.canary-state``, the row the guard writes too), and put both
sides' archived runs side by side.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import click
from sqlalchemy import Engine

from bridge.canary import decisions, sql
from bridge.canary.guard import (
    SideStats,
    Window,
    read_windows,
    summed_window,
    with_yield_loops,
    yield_loops,
)
from bridge.canary.store import CanaryStore
from bridge.canary.weights import (
    DEFAULT,
    OPTION,
    SCALE,
    STATE_OPTION,
    Canary,
    Event,
    parse_weights,
    percent,
    with_weight,
    without_weight,
)
from bridge.cli.tasks import stamp
from bridge.config import ConfigError, Settings, load_settings
from bridge.queue import make_engine
from bridge.queue.implementations import CELERY, LEVELS

OPERATOR_ROLLBACK = "rolled back by an operator"
OPERATOR_PROMOTION = "promoted by an operator"


class Context:
    """What every verb needs: the settings, the worker database and the store."""

    def __init__(self) -> None:
        try:
            self.settings: Settings = load_settings()
        except ConfigError as exc:
            raise click.ClickException(f"configuration error: {exc}") from None
        self.engine: Engine = make_engine(self.settings.database_url)
        self.store = CanaryStore.for_settings(self.engine, self.settings)

    def read(self) -> Canary:
        try:
            return self.store.read()
        except ConfigError as exc:
            raise click.ClickException(f"{exc} (in {self.store.table_name})") from None

    def edit(self, change: Callable[[Any], dict[str, Any]]) -> tuple[Canary, Canary]:
        """The weights edited by ``change`` in place (see ``CanaryStore.edit_weights``);
        returns the canary before and after. A refusal is one line."""
        state = self.read().state
        try:
            before, after = self.store.edit_weights(change)
        except ConfigError as exc:
            raise click.ClickException(f"{exc} (in {self.store.table_name})") from None
        return Canary(parse_weights(before), state), Canary(parse_weights(after), state)

    def now(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(sql.server_time()).scalar_one())

    def known(self, canary: Canary, task_class: str) -> None:
        """A usage error unless ``task_class`` is named in the options, queued, or archived
        within the window: a typo must not roll back a class that does not exist."""
        if task_class in canary.named:
            return
        window = self.settings.canary_window
        with self.engine.connect() as conn:
            seen = (
                conn.execute(sql.queued(task_class)).first()
                or conn.execute(sql.archived_since(task_class, window)).first()
            )
        if not seen:
            raise click.UsageError(
                f"unknown class {task_class!r}: {OPTION} and {STATE_OPTION} do not name it, "
                f"and no task of it is queued or was archived in the last {window} s"
            )


def default_level(canary: Canary, task_class: str) -> str:
    """The level a verb acts on without --level: the class's shared one, else the one
    it was rolled back or configured below 100 at, else ``celery``."""
    shared = canary.level_of(task_class)
    if shared is not None:
        return shared
    for level in LEVELS:
        if canary.state.of(task_class, level).rolled_back:
            return level
    configured = canary.configured(task_class)
    for level in LEVELS:
        ramp = configured.ramp
        if configured.at(level) < SCALE or (ramp is not None and ramp.level == level):
            return level
    return CELERY


def pct(bp: int | float) -> str:
    """Basis points as a percentage: 500 -> ``5%``, 1250 -> ``12.5%``."""
    return f"{percent(int(bp)):g}%"


def configured_text(canary: Canary, task_class: str, level: str) -> str:
    configured = canary.configured(task_class)
    ramp = configured.ramp
    if ramp is not None and ramp.level == level:
        steps = ",".join(f"{percent(s):g}" for s in ramp.steps)
        return f"ramp {steps}% (dwell {ramp.dwell} s)"
    return pct(configured.at(level))


def ramp_text(canary: Canary, task_class: str, level: str, now: int) -> str:
    ramp = canary.configured(task_class).ramp
    if ramp is None or ramp.level != level:
        return "-"
    state = canary.state.of(task_class, level)
    step = min(state.step, len(ramp.steps) - 1)
    since = f" since {stamp(state.step_since, now)}" if state.step_since else ""
    paused = ", paused" if state.paused else ""
    return f"step {step + 1}/{len(ramp.steps)} ({pct(ramp.steps[step])}){since}{paused}"


def rollback_text(canary: Canary, task_class: str, level: str, now: int) -> str:
    state = canary.state.of(task_class, level)
    if not state.rolled_back:
        return "-"
    return f"since {stamp(state.rolled_back_at, now)}: {state.reason}"


def level_json(canary: Canary, task_class: str, level: str) -> dict[str, Any]:
    state = canary.state.of(task_class, level)
    ramp = canary.configured(task_class).ramp
    return {
        "configured": percent(canary.configured(task_class).at(level)),
        "effective": percent(canary.weight(task_class, level)),
        "ramp": None
        if ramp is None or ramp.level != level
        else {
            "steps": [percent(s) for s in ramp.steps],
            "dwell": ramp.dwell,
            "step": state.step,
            "step_since": state.step_since,
            "paused": state.paused,
        },
        "rolled_back": {"at": state.rolled_back_at, "reason": state.reason}
        if state.rolled_back
        else None,
        "version": state.version,
        "judged_since": canary.state.judged_since(task_class, level),
    }


def table(rows: list[list[str]]) -> list[str]:
    """Rows as aligned columns (the first row the header); the last column unpadded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [
        "  ".join(
            [*(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)), row[-1]]
        ).rstrip()
        for row in rows
    ]


@click.group()
def canary() -> None:
    """Canary: the weights that send a share of a class to the new side, its
    rollbacks and the figures of both sides (docs/canary.md).

    The weights are Phorge's config option phorge-bridge.canary, set with
    ./bin/config set --database phorge-bridge.canary '<json>'.
    """


@canary.command()
@click.argument("task_class", metavar="[CLASS]", required=False)
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def status(task_class: str | None, as_json: bool) -> None:
    """Each named class's configured and effective weight per level (the share of its
    tasks the new side runs), its ramp step, and since when and why it is rolled back."""
    ctx = Context()
    current = ctx.read()
    if task_class is not None:
        ctx.known(current, task_class)
    classes = [task_class] if task_class is not None else current.named
    now = ctx.now()
    if as_json:
        click.echo(
            json.dumps(
                {
                    "table": ctx.store.table_name,
                    "classes": {
                        name: {level: level_json(current, name, level) for level in LEVELS}
                        for name in classes
                    },
                    "default": {
                        level: percent(current.configured(DEFAULT).at(level)) for level in LEVELS
                    },
                }
            )
        )
        return
    rows = [["CLASS", "LEVEL", "CONFIGURED", "EFFECTIVE", "RAMP", "ROLLED BACK"]]
    for name in classes:
        for level in LEVELS:
            rows.append(
                [
                    name,
                    level,
                    configured_text(current, name, level),
                    pct(current.weight(name, level)),
                    ramp_text(current, name, level, now),
                    rollback_text(current, name, level, now),
                ]
            )
    if len(rows) > 1:
        for line in table(rows):
            click.echo(line)
    else:
        click.echo(f"no class is named in {OPTION} ({ctx.store.table_name})")
    others = ", ".join(f"{level} {pct(current.configured(DEFAULT).at(level))}" for level in LEVELS)
    click.echo(f"every other class: {others}")


LEVEL_HELP = "celery (phd against Celery's workers) or python (PHP against a native handler)"


def level_option(command: Any) -> Any:
    return click.option(
        "--level",
        type=click.Choice(LEVELS),
        help=f"{LEVEL_HELP}; default: the level the class is shared at, else bridge.",
    )(command)


@canary.command()
@click.argument("task_class", metavar="CLASS")
@level_option
@click.option("--reason", default=OPERATOR_ROLLBACK, show_default=True, help="Why, for history.")
def rollback(task_class: str, level: str | None, reason: str) -> None:
    """Send every task of CLASS back to the old side (weight 0) until `canary promote`."""
    ctx = Context()
    current = ctx.read()
    ctx.known(current, task_class)
    level = level or default_level(current, task_class)
    now = ctx.now()
    decided = decisions.roll_back(ctx.store, task_class, level, now, reason)
    if not decided.done:
        after = Canary(current.weights, decided.state)
        click.echo(
            f"{task_class} ({level}) was already rolled back "
            f"{rollback_text(after, task_class, level, now)}"
        )
        return
    before = pct(current.weight(task_class, level))
    effective = pct(Canary(current.weights, decided.state).weight(task_class, level))
    click.echo(f"rolled back {task_class} ({level}): new side at {effective} (was {before})")


@canary.command()
@click.argument("task_class", metavar="CLASS")
@level_option
@click.option("--reason", default=OPERATOR_PROMOTION, show_default=True, help="Why, for history.")
def promote(task_class: str, level: str | None, reason: str) -> None:
    """Clear CLASS's rollback (a ramp starts again at its first step), or move a ramp
    that is not rolled back to its next step."""
    ctx = Context()
    current = ctx.read()
    ctx.known(current, task_class)
    level = level or default_level(current, task_class)
    ramp = current.configured(task_class).ramp
    what, promoted = decisions.promote(ctx.store, current, task_class, level, ctx.now(), reason)
    effective = pct(Canary(current.weights, promoted).weight(task_class, level))
    if not what:
        raise click.ClickException(
            f"nothing to promote: {task_class} ({level}) is not rolled back"
            + (
                " and its ramp is at its last step"
                if ramp is not None and ramp.level == level
                else " and has no ramp"
            )
            + f"; the new side runs {effective} of it"
        )
    click.echo(f"promoted {task_class} ({level}): {what}, new side at {effective}")


def edited(before: Canary, after: Canary, task_class: str, levels: tuple[str, ...]) -> None:
    """Say what an edit did to ``task_class``'s weights in force at ``levels``."""
    for level in levels:
        was, now = pct(before.weight(task_class, level)), pct(after.weight(task_class, level))
        line = f"{task_class} ({level}): new side at {now} (was {was})"
        if after.state.of(task_class, level).rolled_back:
            line += f"; rolled back: `phorge-bridge canary promote {task_class} --level {level}`"
            line += " applies it"
        click.echo(line)


@canary.command(name="set")
@click.argument("task_class", metavar="CLASS")
@click.argument("weight", metavar="PERCENT", type=click.FloatRange(0, 100))
@click.option(
    "--level", type=click.Choice(LEVELS), default=CELERY, show_default=True, help=LEVEL_HELP
)
def set_weight(task_class: str, weight: float, level: str) -> None:
    """Run PERCENT of CLASS's tasks on the new side of the level. Every other class and
    level stays as it is (`bin/config set` replaces the whole option); a concurrent
    change is not lost, and phd's daemons are not restarted."""
    ctx = Context()
    before, after = ctx.edit(lambda value: with_weight(value, task_class, level, weight))
    edited(before, after, task_class, (level,))


@canary.command()
@click.argument("task_class", metavar="CLASS")
@click.option(
    "--level",
    type=click.Choice(LEVELS),
    help="Only this level's weight (or ramp); default: the class's whole entry.",
)
def unset(task_class: str, level: str | None) -> None:
    """Forget CLASS's weights (or one level's): it then has the "*" entry's."""
    ctx = Context()
    before, after = ctx.edit(lambda value: without_weight(value, task_class, level))
    edited(before, after, task_class, (level,) if level else LEVELS)


def hold_ramp(task_class: str, level: str | None, paused: bool) -> None:
    """Pause or resume CLASS's ramp at the level."""
    ctx = Context()
    current = ctx.read()
    ctx.known(current, task_class)
    level = level or default_level(current, task_class)
    verb = "pause" if paused else "resume"
    ramp = current.configured(task_class).ramp
    if ramp is None or ramp.level != level:
        raise click.ClickException(f"{task_class} has no ramp at the {level} level to {verb}")
    if current.state.of(task_class, level).paused == paused:
        raise click.ClickException(
            f"{task_class} ({level}): its ramp is {'already' if paused else 'not'} paused"
        )
    now = ctx.now()
    reason = f"{verb}d by an operator"
    decided = decisions.hold_ramp(ctx.store, current, task_class, level, now, paused, reason)
    after = Canary(current.weights, decided.state)
    click.echo(
        f"{verb}d the ramp of {task_class} ({level}): {ramp_text(after, task_class, level, now)}"
    )


@canary.command()
@click.argument("task_class", metavar="CLASS")
@level_option
def pause(task_class: str, level: str | None) -> None:
    """Hold CLASS's ramp at its step: the guard still judges it and rolls it back, but
    steps it no further until `canary resume`."""
    hold_ramp(task_class, level, paused=True)


@canary.command()
@click.argument("task_class", metavar="CLASS")
@level_option
def resume(task_class: str, level: str | None) -> None:
    """Let CLASS's paused ramp go on: its next step comes a whole dwell from now."""
    hold_ramp(task_class, level, paused=False)


def side_json(side: SideStats) -> dict[str, Any]:
    return {
        **asdict(side),
        "implementations": list(side.implementations),
        "ratio": side.ratio,
        "followups_per_success": side.followups_per_success,
    }


def event_json(event: Event) -> dict[str, Any]:
    return {
        "at": event.at,
        "level": event.level,
        "event": event.event,
        "weight": event.weight,
        "reason": event.reason,
    }


def seconds_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def followups_text(per_success: float | None) -> str:
    """Follow-ups queued per successful run (of those the bridge labelled)."""
    return "-" if per_success is None else f"{per_success:.2f}/run"


def ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def report_lines(canary: Canary, window: Window, now: int) -> list[str]:
    name, level = window.task_class, window.level
    lines = [f"{name} ({level} level), archived runs of the last {window.seconds} s"]
    rows = [
        [
            "SIDE",
            "RUNS",
            "SUCCESS",
            "P50",
            "P99",
            "TEMPORARY",
            "PERMANENT",
            "FALLBACKS",
            "FOLLOW-UPS",
            "IMPLEMENTATIONS",
        ]
    ]
    for side, stats in (("new", window.new), ("old", window.old)):
        rows.append(
            [
                side,
                str(stats.runs),
                ratio_text(stats.ratio),
                seconds_text(stats.p50),
                seconds_text(stats.p99),
                str(stats.temporary_failures),
                str(stats.permanent_failures),
                str(stats.fallbacks),
                followups_text(stats.followups_per_success),
                ", ".join(stats.implementations) or "-",
            ]
        )
    lines += ["  " + line for line in table(rows)]
    if window.new.yield_loops or window.old.yield_loops:
        lines.append(
            f"in a yield loop now (counted as failed runs): {window.new.yield_loops} rows on the "
            f"new side, {window.old.yield_loops} on the old"
        )
    state = rollback_text(canary, name, level, now)
    weight = (
        f"weight: {pct(canary.weight(name, level))} on the new side "
        f"(configured {configured_text(canary, name, level)})"
    )
    ramp = ramp_text(canary, name, level, now)
    if ramp != "-":
        weight += f", ramp {ramp}"
    if state != "-":
        weight += f", rolled back {state}"
    lines.append(weight)
    version = canary.state.of(name, level).version or "not announced"
    since = canary.state.judged_since(name, level)
    judged = "" if since is None else f", judged afresh since {stamp(since, now)}"
    lines.append(f"new side's version: {version}{judged}")
    history = [e for e in canary.state.history if e.task_class == name]
    if history:
        lines.append("history:")
        for event in history:
            reason = f"  {event.reason}" if event.reason else ""
            lines.append(
                f"  {stamp(event.at, now)}  {event.level:<6}  {event.event:<8}  "
                f"{f'{event.weight:g}%':>5}{reason}"
            )
    else:
        lines.append("history: none")
    return lines


def looping(ctx: Context, canary: Canary, windows: list[Window], now: int) -> list[Window]:
    """``windows`` with each side's rows in a yield loop now, as the guard counts them."""
    default = ctx.settings.canary_max_yielding
    bounds = [
        (w.task_class, w.level, int(canary.configured(w.task_class).bound("max_yielding", default)))
        for w in windows
    ]
    loops = yield_loops(ctx.engine, canary, bounds, now)
    return [with_yield_loops(w, *loops[w.task_class, w.level]) for w in windows]


SPAN_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def span(_ctx: click.Context, _param: click.Parameter, value: str | None) -> int | None:
    """A span of time as an operator types it: ``90``, ``90s``, ``30m``, ``24h``, ``7d``."""
    if value is None:
        return None
    found = re.fullmatch(r"\s*(\d+)\s*([smhd]?)\s*", value)
    if found is None or int(found[1]) == 0:
        raise click.BadParameter(f"{value!r} is not a span (90s, 30m, 24h, 7d)")
    return int(found[1]) * SPAN_UNITS[found[2]]


@canary.command()
@click.argument("task_class", metavar="[CLASS]", required=False)
@level_option
@click.option(
    "--window",
    type=click.IntRange(min=1),
    help="Seconds of archived runs (default: BRIDGE_CANARY_WINDOW, what the guard judges).",
)
@click.option(
    "--since",
    callback=span,
    help="Every run of the span instead (24h, 7d), summed by the database: no durations.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def report(
    task_class: str | None, level: str | None, window: int | None, since: int | None, as_json: bool
) -> None:
    """Both sides of each named class (or CLASS) side by side, over the window: runs,
    success ratio, p50/p99 duration, temporary and permanent failures, fallbacks and
    implementations; then the weight and its history (rollbacks, promotions, steps)."""
    if window is not None and since is not None:
        raise click.UsageError("--window and --since are two spans: give one")
    ctx = Context()
    current = ctx.read()
    if task_class is not None:
        ctx.known(current, task_class)
    classes = [task_class] if task_class is not None else current.named
    seconds = since or window or ctx.settings.canary_window
    now = ctx.now()
    runs = ctx.settings.canary_window_runs
    asked = [(name, level or default_level(current, name)) for name in classes]
    windows = (
        [summed_window(ctx.engine, name, lv, seconds) for name, lv in asked]
        if since
        else read_windows(ctx.engine, [(name, lv, seconds) for name, lv in asked], runs)
    )
    windows = looping(ctx, current, windows, now)
    if as_json:
        shown = []
        for w in windows:
            entry: dict[str, Any] = {"class": w.task_class, "level": w.level, "window": seconds}
            entry.update(new=side_json(w.new), old=side_json(w.old))
            entry.update(level_json(current, w.task_class, w.level))
            entry["history"] = [
                event_json(e) for e in current.state.history if e.task_class == w.task_class
            ]
            shown.append(entry)
        click.echo(json.dumps({"classes": shown}))
        return
    if not windows:
        click.echo(f"no class is named in {OPTION} ({ctx.store.table_name})")
        return
    blocks = ["\n".join(report_lines(current, w, now)) for w in windows]
    click.echo("\n\n".join(blocks))

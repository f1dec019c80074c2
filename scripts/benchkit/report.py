"""The markdown report: how to read it, the machine, then the figures side by side."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from textwrap import indent
from typing import Any

from benchkit import phpreport
from benchkit.ceilings import CeilingResult
from benchkit.plan import Scenario
from benchkit.priority import BACKLOG_PRIORITY, PriorityRun, Spread, Urgent
from benchkit.runner import IO50, NOOP, SLEEP10, Latency, Percentiles, Throughput, Workload
from benchkit.unserved import (
    ROUNDS,
    SERVED_PRIORITY,
    UNSERVED_CLASS,
    UNSERVED_PRIORITY,
    UnservedRun,
)
from benchkit.webtier import PingRun

HOW_TO_READ = """\
**How to read this.** Every consumer drains the same Phorge queue
(`PhabricatorTestWorker` tasks) on the same private, *durable* MariaDB (an fsync per
commit) and, for Celery, the same RabbitMQ. A run enqueues all its tasks in ONE
transaction; the clock starts when that COMMIT returns and stops when the last task is
archived (from the consumer's own record of it; for phd, when the bench saw it, polling
every 10 ms). *tasks/s* is what draining that backlog took, the poll interval or idle
sleep before the first start included. The *reference taskmaster* is Phorge's PHP
taskmaster loop redone statement for statement in Python
(`scripts/benchkit/taskmaster.py`; its SQL matches `phd`'s line for line): 1 process is
what one PHP daemon does. Ratios compare with it (same workload, 1 process), with `phd`
when run, and with the lower of two ceilings the bridge cannot pass (plain Celery with
no database; the bridge's own SQL in a loop without Celery). *Latency* runs from the
enqueue COMMIT to the task's start and to its archive, at light load (one task at a
time, enqueued at a random moment of the consumer's cycle: mostly the poll interval or
idle sleep) and at saturation (the throughput run: mostly queueing). *Cost* is per
archived task over the throughput run: what the consumer's processes sent (counted in
the MySQL driver: statements, commits, round trips; a round trip may carry several
statements), MariaDB's own counters (everything but the bench's polling), and CPU ms:
the worker processes (the bridge's poll runs inside them; its share is shown apart),
MariaDB, and the whole RabbitMQ node (shared: non-zero for the taskmaster means someone
else used it). *machine busy* is the share of all cores in use during the run, and in
parentheses the share no measured process explains (other load on the machine: if it is
large, the figures are disturbed). Failed scenarios are listed at the end with the
reason; they do not stop the others."""


THROUGHPUT_NOTE = (
    "*seconds*: enqueue COMMIT to last archive; *first start*: enqueue COMMIT to the first "
    "task's start (the poll interval or idle sleep). Ratios are of tasks/s."
)


@dataclass
class Result:
    scenario: Scenario
    throughput: Throughput | None = None
    ceiling: CeilingResult | None = None
    light: Latency | None = None
    priority: PriorityRun | None = None
    unserved: UnservedRun | None = None
    ping: PingRun | None = None
    opcache: dict[str, Any] | None = None  # the Conduit web tier's, at start and at the end
    web_requests: int | None = None  # requests the web tier served for the drain (Conduit)
    error: str | None = None
    wall: float = 0.0  # seconds the whole scenario took, start-up included

    @property
    def problems(self) -> list[str]:
        """What went wrong with the tasks of the measured drains (not the error)."""
        problems = list(self.throughput.problems) if self.throughput else []
        if self.unserved:
            problems += self.unserved.alone.problems + self.unserved.behind.problems
        return problems

    @property
    def rate(self) -> float | None:
        if self.throughput and not self.throughput.problems:
            return self.throughput.rate
        if self.ceiling:
            return self.ceiling.rate
        return None


@dataclass
class Context:
    """Everything the report shows besides the results."""

    facts: dict[str, str]
    tuned: dict[str, str]
    notes: list[str] = field(default_factory=list)
    duration: float = 0.0


def table(headers: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def number(value: float | None, digits: int = 0) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value:,.{digits}f}"


def ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "n/a"
    return f"{value / base:.2f}x"


def ms(value: float | None, digits: int = 1) -> str:
    return number(None if value is None else value * 1000, digits)


def busy(t: Throughput | CeilingResult | None) -> str:
    """The machine's CPU use, and in parentheses the part no measured process explains."""
    if t is None:
        return "n/a"
    return f"{t.machine_busy * 100:.0f}% ({t.others_busy * 100:.0f}%)"


def pcts(p: Percentiles | None) -> str:
    return "n/a" if p is None else f"{ms(p.p50)} / {ms(p.p95)} / {ms(p.p99)}"


def label(s: Scenario) -> str:
    if s.kind == "bridge":
        return f"bridge {s.settings}, {s.deployment}"
    if s.kind == "taskmaster":
        return f"reference taskmaster, {s.deployment}"
    if s.kind == "phd":
        return f"phd debug taskmaster, {s.deployment}"
    return s.name


class Report:
    def __init__(self, results: list[Result], context: Context) -> None:
        self.results, self.context = results, context

    def find(self, name: str) -> Result | None:
        return next((r for r in self.results if r.scenario.name == name), None)

    def rate_of(self, name: str) -> float | None:
        found = self.find(name)
        return found.rate if found else None

    def lower_ceiling(self) -> float | None:
        rates = [self.rate_of("ceiling-celery"), self.rate_of("ceiling-sql")]
        known = [r for r in rates if r]
        return min(known) if known else None

    def of_workload(self, workload: Workload, kinds: tuple[str, ...]) -> list[Result]:
        return [
            r for r in self.results if r.scenario.workload == workload and r.scenario.kind in kinds
        ]

    # -- sections -----------------------------------------------------------------------

    def render(self) -> str:
        parts = [
            "# phorge-bridge benchmark",
            HOW_TO_READ,
            "## Machine",
            table(list(self.context.facts), [list(self.context.facts.values())]),
            self.settings(),
            "## Throughput",
            *self.per_workload(self.throughput_table),
            "## Ceilings",
            self.ceilings(),
            "## Latency (ms: p50 / p95 / p99)",
            *self.per_workload(self.latency_table),
            "## Cost per archived task",
            *self.per_workload(self.cost_table),
            self.priority_table(),
            self.unserved_table(),
            phpreport.Section(self.results).render(),
            self.failures(),
        ]
        return "\n\n".join(p for p in parts if p) + "\n"

    def settings(self) -> str:
        tuned = ", ".join(f"`{k}={v}`" for k, v in self.context.tuned.items()) or "(none)"
        lines = [
            "## Set-up",
            "- bridge *default*: only `BRIDGE_DATABASE_URL` and `BRIDGE_BROKER_URL` set.",
            f"- bridge *tuned*: the defaults plus {tuned}.",
            "- each bridge run: `celery -A bridge beat` plus ONE `celery -A bridge worker -Q "
            "bridge.control,phorge` (the poll runs on the control queue in that worker); "
            "prefork for the no-op and 10 ms workloads, `-P threads` for 50 ms.",
            "- every consumer is warmed up with a small batch first (not measured).",
            *self.readme_deployment(),
            *(f"- {note}" for note in self.context.notes),
            f"- whole bench: {self.context.duration / 60:.1f} min.",
        ]
        return "\n".join(lines)

    def readme_deployment(self) -> list[str]:
        """How issue 21's bridge runs differ from the throughput runs, if any ran."""
        if not any(r.scenario.beat_in_worker for r in self.results):
            return []
        return [
            "- issue 21's bridge runs (priority, unserved): ONE `celery -A bridge worker -B` "
            "as the README starts it, default settings, on the broker their table names "
            "(SQLite: a new file per run); the priority runs, which stop with messages "
            "queued, get queue names of their own; warmed up with no-op tasks."
        ]

    def per_workload(self, build: Callable[[Workload], str | None]) -> list[str]:
        sections = []
        for workload in (NOOP, SLEEP10, IO50):
            body = build(workload)
            if body:
                sections += [f"### {workload.label} (`{workload.data_json}`)", body]
        return sections

    def throughput_table(self, workload: Workload) -> str | None:
        results = self.of_workload(workload, ("taskmaster", "phd", "bridge"))
        if not results:
            return None
        bases = [
            self.find(f"taskmaster-{workload.key}-p1"),
            self.find(f"phd-{workload.key}-p1"),
        ]
        ceiling = self.lower_ceiling()
        rows = []
        for r in results:
            t = r.throughput
            rows.append(
                [
                    label(r.scenario),
                    str(r.scenario.tasks),
                    number(t.seconds, 2) if t else "failed",
                    number(t.first_start, 2) if t else "-",
                    f"**{number(r.rate)}**",
                    *(ratio(r.rate, base.rate if base else None) for base in bases),
                    ratio(r.rate, ceiling),
                    busy(t),
                ]
            )
        headers = ["consumer", "tasks", "seconds", "first start (s)", "tasks/s"]
        headers += ["vs taskmaster x1", "vs phd x1", "vs lower ceiling", "machine busy (others)"]
        return THROUGHPUT_NOTE + "\n\n" + table(headers, rows)

    def ceilings(self) -> str:
        rows = []
        celery, sql = self.find("ceiling-celery"), self.find("ceiling-sql")
        if celery:
            c = celery.ceiling
            rows.append(
                [
                    f"plain Celery no-op, 1 worker prefork -c {celery.scenario.concurrency} "
                    f"({c.settings if c else ''})",
                    str(celery.scenario.tasks),
                    f"**{number(celery.rate)}**",
                    ms(c.worker_cpu / c.tasks) if c else "n/a",
                    busy(c),
                ]
            )
        if sql:
            t = sql.throughput
            rows.append(
                [
                    "the bridge's SQL in a loop, no Celery (lease batch, execute each)",
                    str(sql.scenario.tasks),
                    f"**{number(sql.rate)}**",
                    ms(t.cpu.get("workers", 0) / t.tasks) if t else "n/a",
                    busy(t),
                ]
            )
        if not rows:
            return "(not run)"
        headers = ["ceiling", "tasks", "tasks/s", "CPU ms/task (its processes)"]
        headers.append("machine busy (others)")
        return table(headers, rows)

    def latency_table(self, workload: Workload) -> str | None:
        results = self.of_workload(workload, ("taskmaster", "phd", "bridge"))
        rows = []
        for r in results:
            light, t = r.light, r.throughput
            if light is None and t is None:
                continue
            rows.append(
                [
                    label(r.scenario),
                    pcts(light.to_start) if light else "-",
                    pcts(light.to_archive) if light else "-",
                    pcts(t.latency.to_start) if t else "n/a",
                    pcts(t.latency.to_archive) if t else "n/a",
                ]
            )
        if not rows:
            return None
        headers = ["consumer", "light: to start", "light: to archive"]
        return table([*headers, "saturated: to start", "saturated: to archive"], rows)

    def cost_table(self, workload: Workload) -> str | None:
        kinds = ("taskmaster", "phd", "bridge", "ceiling-sql") if workload == NOOP else ()
        results = [r for r in self.of_workload(workload, kinds or ("taskmaster", "phd", "bridge"))]
        rows = [cost_row(r) for r in results if r.throughput]
        if not rows:
            return None
        headers = [
            "consumer", "statements", "commits", "round trips", "Questions", "Com_commit",
            "log writes", "worker CPU", "(poll)", "MariaDB CPU", "RabbitMQ CPU",
        ]  # fmt: skip
        note = (
            "Client-side counts (statements, commits, round trips) come from the consumer's "
            "own processes; server-side ones from MariaDB's global status. *log writes*: "
            "InnoDB's redo log writes (`Innodb_log_writes`), each flushed to disk with "
            "durable commits: concurrent commits share one, a commit that wrote nothing "
            "makes none. CPU in ms per task."
        )
        return note + "\n\n" + table(headers, rows)

    def priority_table(self) -> str | None:
        rows = [priority_row(r) for r in self.results if r.scenario.workload.measure == "priority"]
        if not rows:
            return None
        urgent = Urgent()
        note = (
            f"Issue 21. A backlog queued in one transaction at priority {BACKLOG_PRIORITY}; "
            f"{urgent.head_start:.0f} s after the consumer archived its first row of it, "
            f"{urgent.count} tasks `{urgent.data_json}` at priority {urgent.priority}, one every "
            f"{urgent.every} s, each in its own transaction. Seconds from each urgent "
            "task's enqueue COMMIT to its archive (the bench watches the archive every "
            "10 ms) and to its start (the archive minus the row's `duration`), the same "
            "for every consumer. The bridge runs as the README starts it, `celery -A "
            "bridge worker -B`, with default settings. *backlog done*: backlog tasks "
            "archived when the last urgent one was seen."
        )
        headers = [
            "consumer", "broker", "backlog", "first archive (s)", "to start p50", "to start max",
            "to archive p50", "to archive max", "backlog done",
        ]  # fmt: skip
        return "## Priority under a backlog\n\n" + note + "\n\n" + table(headers, rows)

    def unserved_table(self) -> str | None:
        found = [r for r in self.results if r.scenario.workload.measure == "unserved"]
        rows = [unserved_row(r) for r in found if r.unserved]
        if not rows:
            return None
        note = (
            f"Issue 21. The same consumer drains the same number of no-op rows (priority "
            f"{SERVED_PRIORITY}) {ROUNDS} times alone, then {ROUNDS} times behind rows of "
            f"`{UNSERVED_CLASS}` (no handler: left to PHP) at priority {UNSERVED_PRIORITY}, "
            "queued with INSERT ... SELECT from `seq_1_to_N` and ANALYZE. Tasks/s and CPU "
            "(ms per archived task) are over all drains of a kind, each drain's tasks/s in "
            "parentheses; *ratio*: tasks/s behind over alone."
        )
        headers = [
            "consumer", "broker", "served", "unserved", "alone tasks/s", "behind tasks/s",
            "ratio", "MariaDB CPU alone", "MariaDB CPU behind", "worker CPU alone",
            "worker CPU behind",
        ]  # fmt: skip
        return "## Served rows behind unserved ones\n\n" + note + "\n\n" + table(headers, rows)

    def failures(self) -> str:
        items = []
        for r in self.results:
            problems = r.problems
            if r.error:
                problems.append(r.error)
            for problem in problems:
                first, _, rest = problem.partition("\n")
                item = f"- `{r.scenario.name}`: {first}"
                if rest.strip():
                    item += "\n\n  ```\n" + indent(rest.strip(), "  ") + "\n  ```"
                items.append(item)
        if not items:
            return "## Failures\n\nNone: every task of every run was archived once, result 0."
        return "## Failures\n\n" + "\n".join(items)


def cost_row(r: Result) -> list[str]:
    t = r.throughput
    assert t is not None
    n = t.tasks

    def per(value: float | None, digits: int = 2) -> str:
        return "n/a" if value is None else number(value / n, digits)

    client = t.client
    name = label(r.scenario) if r.scenario.kind != "ceiling-sql" else "bridge SQL loop (ceiling)"
    return [
        name,
        per(client.statements if client else None),
        per(client.commits if client else None),
        per(client.round_trips if client else None),
        per(t.server["Questions"]),
        per(t.server["Com_commit"]),
        per(t.server["Innodb_log_writes"]),
        # Two decimals: the speed target is under 1 ms of worker CPU a task.
        ms(t.cpu.get("workers", 0.0) / n, 2),
        ms(t.poller_cpu / n, 2) if t.poller_cpu is not None else "-",
        ms(t.db_cpu / n, 2),
        ms(t.broker_cpu / n, 2) if t.broker_cpu is not None else "n/a",
    ]


def seconds(spread: Spread | None, which: str) -> str:
    return "n/a" if spread is None else number(getattr(spread, which), 2)


def consumer_columns(s: Scenario) -> list[str]:
    return [label(s), s.broker if s.kind == "bridge" else "-"]


def priority_row(r: Result) -> list[str]:
    run = r.priority
    if run is None:
        return [*consumer_columns(r.scenario), str(r.scenario.tasks), *["failed"] * 6]
    return [
        *consumer_columns(r.scenario),
        f"{run.backlog} x {r.scenario.workload.data_json}",
        number(run.first_archive, 2),
        seconds(run.to_start, "p50"),
        seconds(run.to_start, "max"),
        f"**{seconds(run.to_archive, 'p50')}**",
        f"**{seconds(run.to_archive, 'max')}**",
        str(run.backlog_archived),
    ]


def unserved_row(r: Result) -> list[str]:
    run = r.unserved
    assert run is not None
    drains = (run.alone, run.behind)

    def cpu(of: Callable[[Throughput], float]) -> list[str]:
        return [ms(d.per_task(of), 2) for d in drains]

    return [
        *consumer_columns(r.scenario),
        f"{len(run.alone.runs)} x {run.alone.runs[0].tasks}",
        f"{run.rows:,}",
        *(f"{number(d.rate)} ({' / '.join(number(t.rate) for t in d.runs)})" for d in drains),
        f"**{run.ratio:.2f}x**",
        *cpu(lambda t: t.db_cpu),
        *cpu(lambda t: t.cpu.get("workers", 0.0)),
    ]

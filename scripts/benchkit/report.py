"""The markdown report: a plain table per section, figures side by side."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from benchkit.consumers import CeilingResult
from benchkit.plan import PHP_NOOP, PHP_SEARCH, Scenario
from benchkit.runner import IO50, NOOP, SLEEP10, Latency, Percentiles, Throughput

HOW_TO_READ = """\
Every consumer drains the same Phorge queue on the same private, *durable* MariaDB (an
fsync a commit) and, for Celery, the same RabbitMQ. A run enqueues all its tasks in ONE
transaction; the clock runs from that COMMIT to the last archive (for phd, when the bench
saw it); *tasks/s* includes the wait before the first start. The *reference taskmaster* is
Phorge's taskmaster loop redone statement for statement in Python
(`scripts/benchkit/taskmaster.py`). Ratios compare with it and phd (same workload, one
process) and with the lower ceiling (plain Celery; the bridge's SQL in a loop). *Latency*:
enqueue COMMIT to start and to archive, at light load (one task at a time, at a random
moment) and saturated. *Cost* a task: what the consumer's processes sent (counted in the
MySQL driver), MariaDB's own counters (*log writes*: `Innodb_log_writes`, each a durable
flush), CPU ms by process. *machine busy (others)*: the share of all cores in use, and of
it the share no measured process explains (if large, the figures are disturbed)."""


@dataclass
class Result:
    scenario: Scenario
    throughput: Throughput | None = None
    ceiling: CeilingResult | None = None
    light: Latency | None = None
    error: str | None = None
    opcache: dict[str, Any] | None = None  # the Conduit web tier's, at the end

    @property
    def rate(self) -> float | None:
        if self.throughput and not self.throughput.problems:
            return self.throughput.rate
        return self.ceiling.rate if self.ceiling else None


def table(headers: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def number(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def ratio(value: float | None, base: float | None) -> str:
    return "n/a" if value is None or not base else f"{value / base:.2f}x"


def ms(seconds: float | None, digits: int = 2) -> str:
    return number(None if seconds is None else seconds * 1000, digits)


def pcts(p: Percentiles | None) -> str:
    return "-" if p is None else f"{ms(p.p50, 1)} / {ms(p.p95, 1)} / {ms(p.p99, 1)}"


Run = Throughput | CeilingResult


def busy(t: Run) -> str:
    return f"{t.machine_busy:.0%} ({t.others_busy:.0%})"


def per(t: Throughput, values: Iterable[float | None], digits: int = 2) -> str:
    return " / ".join(number(t.per_task(v), digits) for v in values)


def cpu(t: Throughput, role: str) -> str:
    return ms(t.per_task(t.cpu.get(role)))


def vs_phd(t: Throughput, best: Throughput | None) -> str:
    if best is None:
        return "n/a"
    cpu = ratio(t.machine_cpu / t.tasks, best.machine_cpu / best.tasks)
    return f"{ratio(t.rate, best.rate)} / {cpu}"


def queries(t: Throughput) -> str:
    """MariaDB's queries / commits / log writes a task."""
    return per(t, map(t.server.get, ("Questions", "Com_commit", "Innodb_log_writes")))


def counts(t: Throughput) -> str:
    """What the consumer's processes sent a task."""
    return per(t, (getattr(t.client, n, None) for n in ("statements", "commits", "round_trips")))


Cell = Callable[[Result, Throughput], str]


def vs(base: float | None) -> Cell:
    return lambda r, t: ratio(r.rate, base)


THROUGHPUT: list[tuple[str, Cell]] = [
    ("tasks", lambda r, t: f"{t.tasks:,}"),
    ("tasks/s", lambda r, t: f"**{number(r.rate)}**" if r.rate else "failed"),
    ("first start, s", lambda r, t: number(t.first_start, 2)),
    ("machine busy (others)", lambda r, t: busy(t)),
]
LATENCY: list[tuple[str, Cell]] = [
    ("light: to start", lambda r, t: pcts(r.light.to_start) if r.light else "-"),
    ("light: to archive", lambda r, t: pcts(r.light.to_archive) if r.light else "-"),
    ("saturated: to start", lambda r, t: pcts(t.latency.to_start)),
    ("saturated: to archive", lambda r, t: pcts(t.latency.to_archive)),
]
COST: list[tuple[str, Cell]] = [
    ("statements / commits / round trips", lambda r, t: counts(t)),
    ("MariaDB queries / commits / log writes", lambda r, t: queries(t)),
    ("worker CPU", lambda r, t: cpu(t, "workers")),
    ("beat CPU", lambda r, t: cpu(t, "beat")),
    ("(poll)", lambda r, t: ms(t.per_task(t.poll_cpu))),
    ("MariaDB CPU", lambda r, t: ms(t.per_task(t.db_cpu))),
    ("RabbitMQ CPU", lambda r, t: ms(t.per_task(t.broker_cpu))),
]  # fmt: skip
# The PHP section, a column a consumer; ``best``: the faster phd run of the same work.
PHP_COLUMNS = (("phd x1", "php-phd-{}-p1"), ("phd x2", "php-phd-{}-p2"),
               ("runner", "php-runner-{}"), ("Conduit", "php-conduit-{}"))  # fmt: skip
ROLES = (("phd PHP / bridge Python", "workers"), ("beat", "beat"), ("runner PHP", "runner PHP"),
         ("web-tier PHP", "web-tier PHP"))  # fmt: skip
PHP_ROWS: list[tuple[str, Callable[[Throughput, Throughput | None], str]]] = [
    ("tasks/s", lambda t, best: f"**{number(t.rate)}**"),
    ("first start, s / tasks/s from it",
     lambda t, best: f"{number(t.first_start, 2)} / {number(t.steady_rate)}"),
    ("web requests a task", lambda t, best: per(t, [t.web_requests], 3)),
    ("MariaDB queries / commits / log writes a task", lambda t, best: queries(t)),
    *((f"CPU ms/task, {role}", lambda t, best, key=key: cpu(t, key)) for role, key in ROLES),
    ("CPU ms/task, MariaDB / **machine total**", lambda t, best: f"{ms(t.per_task(t.db_cpu))} / "
     f"{ms(t.per_task(t.machine_cpu))}"),
    ("machine busy (others)", lambda t, best: busy(t)),
    ("tasks/s / machine CPU a task, vs the better phd", lambda t, best: vs_phd(t, best)),
    ("tasks/s from the first starts, vs the better phd",
     lambda t, best: ratio(t.steady_rate, best and best.steady_rate)),
]  # fmt: skip


class Report:
    def __init__(self, results: list[Result], facts: dict[str, str], notes: list[str]) -> None:
        self.results, self.facts, self.notes = results, facts, notes
        self.by_name = {r.scenario.name: r for r in results}

    def rate(self, name: str) -> float | None:
        return self.by_name[name].rate if name in self.by_name else None

    def render(self) -> str:
        facts = table(list(self.facts), [list(self.facts.values())])
        parts = ["# phorge-bridge benchmark", HOW_TO_READ, "## Machine and set-up", facts]
        parts.append("\n".join(f"- {note}" for note in self.notes))
        ceilings = (self.rate("ceiling-celery"), self.rate("ceiling-sql"))
        lower = min(filter(None, ceilings), default=None)
        sections = (("Throughput", THROUGHPUT), ("Latency (ms: p50 / p95 / p99)", LATENCY),
                    ("Cost per archived task (CPU in ms)", COST))  # fmt: skip
        kinds = ("ceiling-sql", "taskmaster", "phd", "bridge")
        for title, base_columns in sections:
            parts.append(f"## {title}")
            for w in (NOOP, SLEEP10, IO50):
                columns = list(base_columns)
                if base_columns is THROUGHPUT:  # ratios to the references of this workload
                    for k in ("taskmaster", "phd"):
                        columns.append((f"vs {k} x1", vs(self.rate(f"{k}-{w.key}-p1"))))
                    columns.append(("vs lower ceiling", vs(lower)))
                runs = [r for r in self.results if r.scenario.workload == w and r.throughput]
                rows = [[r.scenario.label, *(cell(r, r.throughput) for _, cell in columns)]
                        for r in runs if r.scenario.kind in kinds]  # fmt: skip
                if rows:
                    heading = f"### {w.label} (`{w.data_json}`)"
                    parts += [heading, table(["consumer", *(h for h, _ in columns)], rows)]
        parts += [self.ceilings(), self.php(), self.failures()]
        return "\n\n".join(p for p in parts if p) + "\n"

    def ceilings(self) -> str | None:
        def row(label: str, t: Run, rate: float | None, cpu: str) -> list[str]:
            return [label, f"{t.tasks:,}", f"**{number(rate)}**", cpu, busy(t)]

        rows = []
        if (celery := self.by_name.get("ceiling-celery")) and (c := celery.ceiling):
            label = f"plain Celery, -c {celery.scenario.concurrency}, acks late, prefetch 1"
            rows.append(row(label, c, c.rate, ms(c.worker_cpu / c.tasks)))
        if (sql := self.by_name.get("ceiling-sql")) and (t := sql.throughput):
            label = "the bridge's SQL in a loop, no Celery"
            rows.append(row(label, t, sql.rate, cpu(t, "workers")))
        headers = ["ceiling", "tasks", "tasks/s", "CPU ms/task (its processes)"]
        headers.append("machine busy (others)")
        return "## Ceilings\n\n" + table(headers, rows) if rows else None

    def php(self) -> str | None:
        keys = [w.key for w in (PHP_NOOP, PHP_SEARCH)]
        columns = [(h, p) for h, p in PHP_COLUMNS if any(p.format(k) in self.by_name for k in keys)]
        rows = []
        for w in (PHP_NOOP, PHP_SEARCH):
            runs = [self.by_name.get(p.format(w.key)) for _, p in columns]
            ts = [r.throughput if r and r.rate else None for r in runs]
            if not any(ts):
                continue
            phds = [t for t, (_, p) in zip(ts, columns, strict=True) if t and "phd" in p]
            best = max(phds, key=lambda t: t.rate, default=None)
            rows += [
                [f"{w.label}: {label}", *(cell(t, best) if t else "-" for t in ts)]
                for label, cell in PHP_ROWS
            ]
        if not rows:
            return None
        opcache = [f"`{r.scenario.name}` {o['hits'] / max(1, o['hits'] + o.get('misses', 0)):.1%}"
                   for r in self.results if (o := r.opcache) and "hits" in o]  # fmt: skip
        note = (
            "PHP-only classes: `PhorgeBridgeBenchNoopWorker` (the bench's no-op) and "
            "`PhabricatorSearchWorker` re-indexing users. *runner*: `celery -A bridge worker -B` "
            "(prefork, a process a core) with `BRIDGE_PHORGE_ROOT`; *Conduit*: `worker -B -P "
            "threads -c 8` with `BRIDGE_CONDUIT_URL` and a bot's token, to "
            "`PHP_CLI_SERVER_WORKERS=4 php -d opcache.enable=1 -d opcache.enable_cli=1 -S` "
            f"(opcache hits at the end: {', '.join(opcache) or 'n/a'}). Each run is warmed up "
            "with 32 tasks. CPU by process role over whole process trees; *machine total*: "
            "every busy CPU second of the machine."
        )
        headers = ["work", *(h for h, _ in columns)]
        return f"## PHP-only classes (issue 19)\n\n{note}\n\n{table(headers, rows)}"

    def failures(self) -> str:
        items = []
        for r in self.results:
            problems = [*(r.throughput.problems if r.throughput else []), *filter(None, [r.error])]
            for first, _, rest in (problem.partition("\n") for problem in problems):
                trace = f"\n\n```\n{rest.strip()}\n```" if rest.strip() else ""
                items.append(f"- `{r.scenario.name}`: {first}{trace}")
        none = "None: every task of every run was archived once, result 0."
        return "## Failures\n\n" + ("\n".join(items) or none)

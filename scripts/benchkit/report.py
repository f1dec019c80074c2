"""The markdown report: a table per workload, a row per consumer, the columns the figures
docs/benchmarks.md quotes."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from benchkit.plan import PHP_NOOP, PHP_SEARCH, Scenario
from benchkit.runner import IO50, NOOP, SLEEP10, Throughput, Workload

HOW_TO_READ = """\
Every consumer drains the same Phorge queue on the same private, *durable* MariaDB and,
for Celery, the same RabbitMQ. A run enqueues all its tasks in ONE transaction; the clock
runs from that COMMIT to the last archive (for phd, when the bench saw it; for plain
Celery, from the first send). The *reference taskmaster* is Phorge's taskmaster loop,
statement for statement, in Python. *Cost* a task: what the consumer's processes sent
(counted in the MySQL driver), MariaDB's own counters (*log writes*: each a durable
flush), CPU ms by process, *(poll)* the polls' share of the bridge's workers'. *machine
busy (others)*: the share of all cores in use, and of it the share no measured process
explains (if large, the figures are disturbed). docs/benchmarks.md says more."""


@dataclass
class Result:
    scenario: Scenario
    throughput: Throughput | None = None
    error: str | None = None

    @property
    def rate(self) -> float | None:
        t = self.throughput
        return t.rate if t and not t.problems else None


Column = tuple[str, Callable[[Throughput], str]]


def table(headers: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def number(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def ratio(value: float | None, base: float | None) -> str:
    return "n/a" if value is None or not base else f"{value / base:.2f}x"


def per(t: Throughput, *values: float | None, digits: int = 2) -> str:
    """Counts a task, ``/``-separated."""
    return " / ".join(number(t.per_task(v), digits) for v in values)


def ms(t: Throughput, *seconds: float | None) -> str:
    """CPU seconds as ms a task, ``/``-separated."""
    return per(t, *(None if s is None else s * 1000 for s in seconds))


def cpu(t: Throughput) -> str:
    rest = ms(t, t.cpu.get("beat"), t.db_cpu, t.broker_cpu)
    return f"{ms(t, t.cpu.get('workers'))} ({ms(t, t.poll_cpu)}) / {rest}"


COLUMNS: list[Column] = [
    ("tasks", lambda t: f"{t.tasks:,}"),
    ("first start, s", lambda t: number(t.first_start, 2)),
    ("statements / commits / round trips", lambda t: per(t, *(t.client or (None,) * 3))),
    ("MariaDB queries / commits / log writes", lambda t: per(t, *map(t.server.get, (
        "Questions", "Com_commit", "Innodb_log_writes")))),
    ("CPU ms: worker (poll) / beat / MariaDB / RabbitMQ", cpu),
    ("machine busy (others)", lambda t: f"{t.machine_busy:.0%} ({t.others_busy:.0%})"),
]  # fmt: skip
PHP_COLUMNS: list[Column] = [
    ("first start, s / tasks/s from it",
     lambda t: f"{number(t.first_start, 2)} / {number(t.steady_rate)}"),
    ("web requests a task", lambda t: per(t, t.web_requests, digits=3)),
    COLUMNS[3],
    ("CPU ms: phd PHP or bridge Python / beat / runner PHP / web-tier PHP",
     lambda t: ms(t, *map(t.cpu.get, ("workers", "beat", "runner PHP", "web-tier PHP")))),
    ("CPU ms: MariaDB / **machine total**", lambda t: ms(t, t.db_cpu, t.machine_cpu)),
    COLUMNS[-1],
]  # fmt: skip


def versus(bases: list[float | None]) -> Column:
    def cell(t: Throughput) -> str:
        return " / ".join(ratio(None if t.problems else t.rate, base) for base in bases)

    return "vs reference / phd x1 / lower ceiling", cell


def versus_phd(best: Throughput | None) -> Column:
    """The PHP section's ratios, to the faster phd run of the same work."""

    def cell(t: Throughput) -> str:
        if best is None or t.problems:
            return "n/a"
        machine = ratio(t.machine_cpu / t.tasks, best.machine_cpu / best.tasks)
        return f"{ratio(t.rate, best.rate)} / {machine} / {ratio(t.steady_rate, best.steady_rate)}"

    return "vs the better phd: tasks/s / machine CPU a task / tasks/s from first starts", cell


class Report:
    def __init__(self, results: list[Result], facts: dict[str, str], notes: list[str]) -> None:
        self.results, self.facts, self.notes = results, facts, notes

    def rate(self, name: str) -> float | None:
        return next((r.rate for r in self.results if r.scenario.name == name), None)

    def section(self, w: Workload, columns: list[Column]) -> list[str]:
        """A row per consumer that ran ``w``, tasks/s first."""
        rows = [
            [r.scenario.label, f"**{number(r.rate)}**" if r.rate else "failed",
             *(cell(r.throughput) for _, cell in columns)]
            for r in self.results if r.throughput and r.scenario.workload == w
        ]  # fmt: skip
        headers = ["consumer", "tasks/s", *(h for h, _ in columns)]
        data = f" (`{w.data}`)" if isinstance(w.data, str) else ""  # search: users in turn
        return [f"## {w.label}{data}", table(headers, rows)] if rows else []

    def render(self) -> str:
        facts = table(list(self.facts), [list(self.facts.values())])
        parts = ["# phorge-bridge benchmark", HOW_TO_READ, "## Machine and set-up", facts]
        parts.append("\n".join(f"- {note}" for note in self.notes))
        lower = min(filter(None, map(self.rate, ("ceiling-celery", "ceiling-sql"))), default=None)
        for w in (NOOP, SLEEP10, IO50):
            bases = [self.rate(f"taskmaster-{w.key}-p1"), self.rate(f"phd-{w.key}-p1"), lower]
            parts += self.section(w, [versus(bases), *COLUMNS])
        for w in (PHP_NOOP, PHP_SEARCH):
            phds = [r for r in self.results if r.scenario.kind == "php-phd" and r.rate]
            phds = [r for r in phds if r.scenario.workload == w]
            best = max(phds, key=lambda r: r.rate or 0, default=None)
            parts += self.section(w, [versus_phd(best and best.throughput), *PHP_COLUMNS])
        parts.append(self.failures())
        return "\n\n".join(p for p in parts if p) + "\n"

    def failures(self) -> str:
        items = []
        for r in self.results:
            problems = [*(r.throughput.problems if r.throughput else []), *filter(None, [r.error])]
            for first, _, rest in (problem.partition("\n") for problem in problems):
                trace = f"\n\n```\n{rest.strip()}\n```" if rest.strip() else ""
                items.append(f"- `{r.scenario.name}`: {first}{trace}")
        none = "None: every task of every run was archived once, result 0."
        return "## Failures\n\n" + ("\n".join(items) or none)

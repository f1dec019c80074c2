"""The PHP section of the report (issue 19): phd, the PHP runner and Conduit side by side.

Kept apart from ``report`` because its figures are compared with targets that name
other scenarios (the better of phd x1 and x2, phd x1), and a miss must show as plainly
as a success: :func:`targets` is pure arithmetic on the measured figures, tested on its
own, and every target prints its ratio next to its verdict, or "not measured".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from benchkit import webtier
from benchkit.php import PHP_NOOP, PHP_SEARCH
from benchkit.phpconsumers import ROLES
from benchkit.runner import Percentiles, Throughput, Workload

if TYPE_CHECKING:
    from benchkit.report import Result

# (column header, scenario name pattern): ``{w}`` is the workload's key. The ping run's
# drain is one more Conduit no-op run, of more tasks: a column of its own, no-op only.
COLUMNS = (
    ("phd x1", "php-phd-{w}-p1"),
    ("phd x2", "php-phd-{w}-p2"),
    ("runner", "php-runner-{w}"),
    ("runner, threads -c 8", "php-runner-{w}-t8"),
    ("Conduit", "php-conduit-{w}"),
    ("Conduit, the ping run's drain", "php-conduit-ping"),
)
WORKLOADS = (PHP_NOOP, PHP_SEARCH)


def scenario_name(pattern: str, w: Workload) -> str | None:
    """The column's scenario for ``w``, if it has one."""
    if "{w}" not in pattern and w != PHP_NOOP:
        return None
    return pattern.format(w=w.key)


@dataclass(frozen=True)
class Figure:
    """What the targets need of one run."""

    rate: float | None  # tasks/s from the enqueue COMMIT
    machine_cpu: float | None  # machine CPU seconds a task, whoever used it
    steady: float | None = None  # tasks/s from the first start


NONE = Figure(None, None)


def figure_of(t: Throughput | None) -> Figure:
    if t is None or t.problems:
        return NONE
    machine = t.machine_cpu / t.tasks if t.machine_cpu is not None else None
    return Figure(t.rate, machine, steady_rate(t))


@dataclass(frozen=True)
class Target:
    text: str
    value: float | None  # the measured ratio
    bound: float
    at_least: bool  # met when value >= bound (else when value <= bound)
    detail: str = ""
    steady: float | None = None  # a rate target's ratio from the first starts

    def meets(self, value: float | None) -> bool | None:
        if value is None or math.isnan(value):
            return None
        return value >= self.bound if self.at_least else value <= self.bound

    @property
    def met(self) -> bool | None:
        return self.meets(self.value)

    @property
    def verdict(self) -> str:
        return VERDICTS[self.met]

    @property
    def steady_verdict(self) -> str:
        """The verdict from the first starts, for a rate target ("-" for the others)."""
        if self.steady is None:
            return "-"
        return f"{self.steady:.2f}x: {VERDICTS[self.meets(self.steady)]}"


VERDICTS = {True: "met", False: "**not met**", None: "not measured"}


def quotient(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def better(*figures: Figure, steady: bool = False) -> Figure:
    """The faster of some phd runs (the one a target compares with), from the enqueue
    COMMIT or, with ``steady``, from the first start."""

    def speed(f: Figure) -> float | None:
        return f.steady if steady else f.rate

    known = [f for f in figures if speed(f) is not None]
    return max(known, key=lambda f: speed(f) or 0.0) if known else NONE


def targets(figures: dict[str, Figure], ping_ratio: float | None) -> list[Target]:
    """Issue 19's targets from the runs' figures, by scenario name (missing: not measured)."""

    def get(name: str) -> Figure:
        return figures.get(name, NONE)

    def phd(workload: str, steady: bool = False) -> Figure:
        runs = (get(f"php-phd-{workload}-p1"), get(f"php-phd-{workload}-p2"))
        return better(*runs, steady=steady)

    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1000:.2f} ms"

    def rate(value: float | None) -> str:
        return "n/a" if value is None else f"{value:,.0f}/s"

    noop_phd, search_phd, phd1 = phd("noop"), phd("search"), get("php-phd-noop-p1")
    runner, search = get("php-runner-noop"), get("php-runner-search")
    conduit = get("php-conduit-noop")
    return [
        Target(
            "runner no-op >= 2x the better of phd x1/x2 (tasks/s)",
            quotient(runner.rate, noop_phd.rate), 2.0, True,
            f"runner {rate(runner.rate)}, phd {rate(noop_phd.rate)}",
            quotient(runner.steady, phd("noop", steady=True).steady),
        ),
        Target(
            "runner no-op machine CPU a task <= the better phd's",
            quotient(runner.machine_cpu, noop_phd.machine_cpu), 1.0, False,
            f"runner {ms(runner.machine_cpu)}, phd {ms(noop_phd.machine_cpu)}",
        ),
        Target(
            "runner PhabricatorSearchWorker >= 1.5x the better of phd x1/x2 (tasks/s)",
            quotient(search.rate, search_phd.rate), 1.5, True,
            f"runner {rate(search.rate)}, phd {rate(search_phd.rate)}",
            quotient(search.steady, phd("search", steady=True).steady),
        ),
        Target(
            "Conduit no-op >= 1x phd x1 (tasks/s)",
            quotient(conduit.rate, phd1.rate), 1.0, True,
            f"Conduit {rate(conduit.rate)}, phd x1 {rate(phd1.rate)}",
            quotient(conduit.steady, phd1.steady),
        ),
        Target(
            "Conduit no-op machine CPU a task <= 3x phd x1's",
            quotient(conduit.machine_cpu, phd1.machine_cpu), 3.0, False,
            f"Conduit {ms(conduit.machine_cpu)}, phd x1 {ms(phd1.machine_cpu)}",
        ),
        Target(
            "conduit.ping p95 during a drain through Conduit <= 2x idle",
            ping_ratio, 2.0, False, "see the conduit.ping table",
        ),
    ]  # fmt: skip


TARGETS_NOTE = (
    "*measured*: the ratio of the figures on the right (tasks/s from the enqueue COMMIT, as "
    "in the rest of the report; machine CPU a task; ping p95), and *result* its verdict. "
    "*from the first starts*: a rate target's ratio and verdict on tasks/s from each "
    "run's first start. A run follows its warm-up at once, so an idle phd is always at the "
    "start of its 1 s sleep (its first start is 1 s after the COMMIT, the bridge's 0.25 s "
    "at most): the first figure counts that wait, the second does not."
)


def table(headers: list[str], rows: Sequence[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def num(value: float | None, digits: int = 0) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value:,.{digits}f}"


def per_task_ms(value: float | None, t: Throughput, digits: int = 2) -> str:
    return "n/a" if value is None else num(value / t.tasks * 1000, digits)


def measured_total(t: Throughput) -> float:
    """CPU seconds of every process the bench accounts for (roles, MariaDB, RabbitMQ, bench)."""
    return sum(t.cpu.values()) + t.db_cpu + (t.broker_cpu or 0.0) + (t.bench_cpu or 0.0)


class Section:
    """The section's tables from the results of the PHP-section scenarios."""

    def __init__(self, results: list[Result]) -> None:
        self.by_name = {r.scenario.name: r for r in results if r.scenario.name.startswith("php-")}

    def throughput(self, name: str) -> Throughput | None:
        found = self.by_name.get(name)
        return found.throughput if found else None

    def columns(self) -> list[tuple[str, str]]:
        """The columns some workload ran (threads -c 8 only when it was measured)."""
        return [
            (header, pattern)
            for header, pattern in COLUMNS
            if any(scenario_name(pattern, w) in self.by_name for w in WORKLOADS)
        ]

    def render(self) -> str | None:
        if not self.by_name:
            return None
        ping = self.by_name.get("php-conduit-ping")
        figures = {name: figure_of(r.throughput) for name, r in self.by_name.items()}
        found = targets(figures, ping.ping.ratio if ping and ping.ping else None)
        parts = [
            "## PHP-only classes: phd, the PHP runner, Conduit (issue 19)",
            NOTE,
            self.figures_table(),
            "### Against issue 19's targets",
            TARGETS_NOTE,
            table(
                ["target", "measured", "result", "from the first starts", "figures"],
                [
                    [t.text, ratio_text(t.value, 1.0), t.verdict, t.steady_verdict, t.detail]
                    for t in found
                ],
            ),
            self.ping_table(),
            self.web_tier_note(),
        ]
        return "\n\n".join(p for p in parts if p)

    def figures_table(self) -> str:
        columns = self.columns()
        rows: list[list[str]] = []
        for workload in WORKLOADS:
            runs = [
                self.by_name.get(scenario_name(pattern, workload) or "") for _, pattern in columns
            ]
            if any(r and r.throughput for r in runs):
                rows += self.workload_rows(workload, runs)
        return table(["work", *(header for header, _ in columns)], rows)

    def workload_rows(self, w: Workload, runs: list[Result | None]) -> list[list[str]]:
        best = better(*(figure_of(self.throughput(f"php-phd-{w.key}-p{n}")) for n in (1, 2)))

        def row(label: str, cell: Callable[[Throughput], str]) -> list[str]:
            cells = [cell(r.throughput) if r and r.throughput else "-" for r in runs]
            return [f"{w.label}: {label}", *cells]

        def role_ms(role: str) -> Callable[[Throughput], str]:
            return lambda t: per_task_ms(t.cpu[role], t) if role in t.cpu else "-"

        def requests(r: Result | None) -> str:
            if r is None or r.throughput is None or r.web_requests is None:
                return "-"
            return num(r.web_requests / r.throughput.tasks, 3)

        throughputs = [r.throughput for r in runs if r and r.throughput]
        roles = [role for role in ROLES if any(role in t.cpu for t in throughputs)]
        return [
            row("tasks", lambda t: f"{t.tasks:,}"),
            row("tasks/s", lambda t: f"**{num(t.rate)}**" if not t.problems else "failed"),
            row("first start, s", lambda t: num(t.first_start, 2)),
            row("tasks/s from the first start", lambda t: num(steady_rate(t))),
            row("PHP's own run (archived duration), ms", lambda t: per_ms(t.mean_duration)),
            [f"{w.label}: web requests a task", *(requests(r) for r in runs)],
            row("MariaDB queries / commits / log writes a task", server_counts),
            *(row(f"CPU ms/task, {role}", role_ms(role)) for role in roles),
            row("CPU ms/task, MariaDB", lambda t: per_task_ms(t.db_cpu, t)),
            row("CPU ms/task, RabbitMQ", lambda t: per_task_ms(t.broker_cpu, t)),
            row("CPU ms/task, the bench (enqueue, polling)", lambda t: per_task_ms(t.bench_cpu, t)),
            row("CPU ms/task, measured total", lambda t: per_task_ms(measured_total(t), t)),
            row("CPU ms/task, **machine total**", lambda t: per_task_ms(t.machine_cpu, t)),
            row("machine busy (others)", lambda t: f"{t.machine_busy:.0%} ({t.others_busy:.0%})"),
            row("tasks/s vs the better phd", lambda t: ratio_text(figure_of(t).rate, best.rate)),
            row(
                "machine CPU a task vs the better phd",
                lambda t: ratio_text(figure_of(t).machine_cpu, best.machine_cpu),
            ),
        ]

    def ping_table(self) -> str | None:
        found = self.by_name.get("php-conduit-ping")
        if found is None:
            return None
        run = found.ping
        if run is None:
            return "### conduit.ping\n\n(not measured: see Failures)"
        t = found.throughput
        drain = f"{t.tasks:,} no-op tasks through Conduit at {num(t.rate)}/s" if t else "a drain"
        rows = [
            ping_row("idle (before the drain)", run.idle, run.idle_p),
            ping_row(f"during the drain ({drain})", run.during, run.during_p),
        ]
        text = (
            f"Sequential `conduit.ping` POSTs (no token), one every "
            f"{webtier.PING_EVERY * 1000:.0f} ms or as soon as the last answered, from the "
            "bench's process: first idle (the bridge running, the queue empty), then from "
            "the drain's enqueue COMMIT to its last archive. ms; p95 during over idle: "
            f"**{num(run.ratio, 2)}x** (target: at most 2x). Failed pings during the drain: "
            f"{len(run.errors)}{': ' + run.errors[0] if run.errors else ''}."
        )
        headers = ["conduit.ping", "pings", "p50", "p95", "p99", "max"]
        return (
            "### conduit.ping, idle and during a drain through Conduit\n\n"
            + text
            + "\n\n"
            + (table(headers, rows))
        )

    def web_tier_note(self) -> str | None:
        seen = [(name, r.opcache) for name, r in self.by_name.items() if r.opcache and r.throughput]
        if not seen:
            return None
        lines = []
        for name, status in seen:
            start, end = status.get("start", {}), status.get("end", {})
            hits, misses = end.get("hits", 0), end.get("misses", 0)
            rate = f"{hits / (hits + misses):.1%}" if hits + misses else "n/a"
            lines.append(
                f"`{name}`: opcache {'on' if start.get('enabled') else 'OFF'} "
                f"(SAPI {start.get('sapi', '?')}); at the end {end.get('scripts', '?')} scripts "
                f"cached, hit rate {rate}"
            )
        flags = " ".join(webtier.OPCACHE_FLAGS)
        return (
            f"Web tier: `PHP_CLI_SERVER_WORKERS={webtier.WORKERS} php {flags} -S ...` with "
            "Phorge's rewrite rule as router, started for each Conduit run; the router's "
            "`/__bench/opcache` answered `opcache_get_status()` of a worker at start (the "
            "bench refuses a web tier without opcache) and at the end: " + "; ".join(lines) + "."
        )


def steady_rate(t: Throughput) -> float | None:
    """Tasks/s without the wait before the first start (phd's idle sleep, the poll)."""
    running = t.seconds - t.first_start
    return t.tasks / running if running > 0 else None


def server_counts(t: Throughput) -> str:
    """MariaDB's own counters a task (everything but the bench's polling)."""
    names = ("Questions", "Com_commit", "Innodb_log_writes")
    return " / ".join(num(t.server[n] / t.tasks, 2) if n in t.server else "n/a" for n in names)


def per_ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else num(seconds * 1000, 2)


def ratio_text(value: float | None, base: float | None) -> str:
    found = quotient(value, base)
    return "n/a" if found is None else f"{found:.2f}x"


def ping_row(label: str, took: list[float], p: Percentiles | None) -> list[str]:
    if p is None:
        return [label, str(len(took)), "n/a", "n/a", "n/a", "n/a"]
    return [
        label,
        f"{len(took):,}",
        per_ms(p.p50),
        f"**{per_ms(p.p95)}**",
        per_ms(p.p99),
        per_ms(max(took)),
    ]


NOTE = """\
Classes only PHP can run, on the same durable MariaDB and Phorge copy as phd: \
`PhorgeBridgeBenchNoopWorker` (a bench-only no-op) and `PhabricatorSearchWorker` \
re-indexing real users. *phd*: `bin/phd debug taskmaster` x1 and x2. *runner*: the \
README's default `celery -A bridge worker -B` (prefork, one process per core) with \
`BRIDGE_PHORGE_ROOT` set (a long-lived PHP process per pool slot); *runner, threads -c \
8*: the same with `-P threads -c 8`. *Conduit*: `celery -A bridge worker -B -P threads \
-c 8` with `BRIDGE_CONDUIT_URL`/`BRIDGE_CONDUIT_TOKEN` and no `BRIDGE_PHORGE_ROOT`, \
the tasks run by `worker.execute` requests to the web tier below. Default settings otherwise; \
RabbitMQ. Each run starts once the machine was at most 15% busy for a second (waiting 60 \
s at most: it is shared), and is warmed up with 32 tasks of its class first. *tasks/s* from the \
enqueue COMMIT to the last archive (for phd, as the bench's polling saw it), as everywhere in \
this report: the wait before the first start (phd's idle sleep of up to 1 s, the \
bridge's 0.25 s poll) included; *from the first start* leaves it out. *web requests a \
task*: connections the web tier accepted during the drain (pings excluded) per task: \
below 1 when `worker.execute` carries several tasks. *PHP's own run*: the mean \
`duration` the archive rows hold (PHP's run time, as each consumer records it). CPU ms \
per archived task by process role (/proc, whole process trees: phd's daemon leaves its \
session): *phd PHP* (overseer and daemon), *bridge Python* (the Celery worker and its \
pool), *beat* (the process `-B` forks), *runner PHP*, *web-tier PHP*; *measured total* \
adds MariaDB, RabbitMQ and the bench; *machine total* is every busy CPU second of the \
machine during the run, whoever used it (what the CPU targets compare), and *machine \
busy (others)* shows how much no measured process explains. Ratios compare within this \
run only."""

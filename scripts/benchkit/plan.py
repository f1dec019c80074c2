"""Which scenarios a run measures, named so that ``--only`` can pick them with globs.

Names: ``ceiling-celery``, ``ceiling-sql``, ``taskmaster-<workload>-p<N>``,
``phd-<workload>-p<N>``, ``bridge-<default|tuned>-<workload>-<c|t><N>[-<broker>]`` (``c``:
prefork processes, ``t``: threads), workloads ``noop``, ``10ms``, ``io50`` and issue 21's
``priority``, ``priority-1s`` and ``unserved``. The throughput workloads' bridge runs on
the bench's RabbitMQ with a separate beat; issue 21's as the README starts it, ``celery -A
bridge worker -B``, on the embedded SQLite broker unless the name ends in ``-redis`` or
``-rabbitmq``. Issue 19's PHP section, only with a Phorge checkout: ``php-phd-<w>-p<N>``,
``php-runner-<w>[-t8]`` and ``php-conduit-<w>`` on PHP-only classes (``noop``,
``search``), and ``php-conduit-ping``; its bridge runs as the README starts it, ``worker
-B``, on the bench's RabbitMQ.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

from benchkit.php import PHP_NOOP, PHP_PING, PHP_SEARCH
from benchkit.runner import IO50, NOOP, PRIORITY, PRIORITY_1S, SLEEP10, UNSERVED, Workload


@dataclass(frozen=True)
class Sizes:
    """Task counts and pool sizes; ``--quick`` shrinks them."""

    noop: int = 3000  # the size of the speed issue's own measurement; steadier than 2,000
    sleep10: int = 1000
    io50: int = 1000
    reference_io50: int = 100  # the reference taskmaster runs 50 ms tasks one at a time
    ceiling: int = 4000
    light: int = 30
    prefork: tuple[int, ...] = (1, 2, 4)
    # 10 ms tasks wait more than they compute: 4 processes cap them near 4 x 1000 / 15
    # (the sleep, the check, the durable commit and Celery's gap between tasks).
    sleep10_prefork: tuple[int, ...] = (1, 2, 4, 16)
    # No pipes to the children: what the threads pool saves on the shortest tasks.
    noop_threads: tuple[int, ...] = (4,)
    threads: tuple[int, ...] = (8, 16, 32)
    taskmasters: tuple[int, ...] = (1, 2)
    ceiling_concurrency: int = 4
    backlog: int = 3000  # 50 ms tasks ahead of the urgent ones
    backlog_1s: int = 200
    unserved: int = 300_000  # rows left to PHP, queued ahead of ...
    served: int = 3000  # ... the no-op rows the bridge drains
    # Issue 19's PHP section (PHP-only classes): the whole section in under 10 minutes.
    php_noop: int = 3000  # as the other no-op runs: 2,000 last under 3 s on the runner
    php_search: int = 1000
    php_ping: int = 5000  # no-op tasks drained through Conduit while conduit.ping ...
    php_ping_idle: int = 200  # ... and this many pings before it, the idle figure


QUICK = Sizes(
    noop=300,
    sleep10=200,
    io50=200,
    reference_io50=40,
    ceiling=1000,
    light=10,
    prefork=(2,),
    sleep10_prefork=(2,),
    noop_threads=(),
    threads=(16,),
    taskmasters=(1,),
    backlog=300,
    backlog_1s=20,
    unserved=30_000,
    served=300,
    php_noop=200,
    php_search=60,
    php_ping=500,
    php_ping_idle=40,
)
PHP_KINDS = ("php-phd", "php-runner", "php-conduit")
CORES = os.cpu_count() or 1  # celery worker's default concurrency
CONDUIT_THREADS = 8  # the README's Conduit worker: -P threads -c 8

SQLITE, REDIS, RABBITMQ = "sqlite", "redis", "rabbitmq"
BROKERS = (SQLITE, REDIS, RABBITMQ)
DEFAULT_BROKER = SQLITE  # the README's: BRIDGE_BROKER_URL's default


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str  # ceiling-celery | ceiling-sql | taskmaster | phd | bridge
    workload: Workload
    tasks: int
    light: int = 0  # light-load latency samples, 0 for none
    settings: str = ""  # bridge: "default" or "tuned"
    pool: str = "prefork"
    concurrency: int = 1  # bridge: -c; taskmaster/phd: processes
    broker: str = RABBITMQ  # bridge: SQLITE, REDIS or RABBITMQ
    beat_in_worker: bool = False  # bridge: ``worker -B`` (the README) or a beat of its own

    @property
    def deployment(self) -> str:
        """How the consumer ran, for the report."""
        if self.kind == "bridge":
            return f"{self.pool} -c {self.concurrency}"
        if self.kind in ("php-runner", "php-conduit"):
            return f"worker -B, {self.pool} -c {self.concurrency}"
        if self.kind in ("taskmaster", "phd", "php-phd"):
            return f"{self.concurrency} process{'es' if self.concurrency > 1 else ''}"
        return ""


def workloads(sizes: Sizes) -> list[tuple[Workload, int, str, tuple[int, ...]]]:
    """(workload, tasks, bridge pool, bridge concurrencies)."""
    return [
        (NOOP, sizes.noop, "prefork", sizes.prefork),
        (NOOP, sizes.noop, "threads", sizes.noop_threads),
        (SLEEP10, sizes.sleep10, "prefork", sizes.sleep10_prefork),
        (IO50, sizes.io50, "threads", sizes.threads),
    ]


def references(kind: str, sizes: Sizes) -> list[Scenario]:
    """Phorge-style taskmasters: every process count on no-op, one process on 10 ms (what
    the ratios compare with) and, the reference taskmaster only, on 50 ms."""
    runs = [(NOOP, sizes.noop, n) for n in sizes.taskmasters] + [(SLEEP10, sizes.sleep10, 1)]
    if kind == "taskmaster":
        runs.append((IO50, sizes.reference_io50, 1))
    found = []
    for workload, tasks, n in runs:
        light = sizes.light if n == sizes.taskmasters[0] and workload != IO50 else 0
        name = f"{kind}-{workload.key}-p{n}"
        found.append(Scenario(name, kind, workload, tasks, light, concurrency=n))
    return found


def bridge(sizes: Sizes) -> list[Scenario]:
    found = []
    for settings in ("default", "tuned"):
        sampled = set()  # light-load latency: once per workload, at its first deployment
        for workload, tasks, pool, concurrencies in workloads(sizes):
            for n in concurrencies:
                light = 0 if workload.key in sampled else sizes.light
                sampled.add(workload.key)
                letter = "t" if pool == "threads" else "c"
                name = f"bridge-{settings}-{workload.key}-{letter}{n}"
                found.append(Scenario(name, "bridge", workload, tasks, light, settings, pool, n))
    return found


def issue21(sizes: Sizes, with_phd: bool, brokers: tuple[str, ...]) -> list[Scenario]:
    """Urgent tasks behind a backlog, and served rows behind unserved ones: the reference
    taskmaster and phd (one process each, as the issue measured), then the bridge as the
    README starts it, on every broker for the 50 ms backlog and the unserved rows."""
    kinds = ("taskmaster", "phd") if with_phd else ("taskmaster",)
    backlogs = ((PRIORITY, sizes.backlog), (PRIORITY_1S, sizes.backlog_1s))
    found = [
        Scenario(f"{kind}-{workload.key}-p1", kind, workload, tasks)
        for workload, tasks in backlogs
        for kind in kinds
    ]
    bridges = [
        (PRIORITY, sizes.backlog, "prefork", 2, brokers),
        (PRIORITY_1S, sizes.backlog_1s, "prefork", 2, (DEFAULT_BROKER,)),
        (PRIORITY_1S, sizes.backlog_1s, "threads", 8, (DEFAULT_BROKER,)),
        (UNSERVED, sizes.served, "prefork", 2, brokers),
    ]
    for workload, tasks, pool, n, on in bridges:
        letter = "t" if pool == "threads" else "c"
        for broker in on:
            suffix = "" if broker == DEFAULT_BROKER else f"-{broker}"
            found.append(
                Scenario(
                    f"bridge-default-{workload.key}-{letter}{n}{suffix}", "bridge", workload,
                    tasks, settings="default", pool=pool, concurrency=n, broker=broker,
                    beat_in_worker=True,
                )
            )  # fmt: skip
    return found


def php(sizes: Sizes) -> list[Scenario]:
    """Issue 19's PHP section: phd x1 and x2, the bridge on the PHP runner (the README's
    default, prefork one process per core, and threads -c 8 for the no-op) and through
    Conduit (threads -c 8), on the no-op class and on search; then conduit.ping during a
    drain through Conduit."""
    found = []
    for workload, tasks in ((PHP_NOOP, sizes.php_noop), (PHP_SEARCH, sizes.php_search)):
        for n in (1, 2):
            found.append(
                Scenario(f"php-phd-{workload.key}-p{n}", "php-phd", workload, tasks, concurrency=n)
            )
    runners = [
        ("php-runner-noop", PHP_NOOP, sizes.php_noop, "prefork", CORES),
        ("php-runner-noop-t8", PHP_NOOP, sizes.php_noop, "threads", CONDUIT_THREADS),
        ("php-runner-search", PHP_SEARCH, sizes.php_search, "prefork", CORES),
    ]
    conduits = [
        ("php-conduit-noop", PHP_NOOP, sizes.php_noop),
        ("php-conduit-search", PHP_SEARCH, sizes.php_search),
        ("php-conduit-ping", PHP_PING, sizes.php_ping),
    ]
    for name, workload, tasks, pool, n in runners:
        found.append(
            Scenario(
                name, "php-runner", workload, tasks, settings="default", pool=pool,
                concurrency=n, beat_in_worker=True,
            )
        )  # fmt: skip
    for name, workload, tasks in conduits:
        found.append(
            Scenario(
                name, "php-conduit", workload, tasks, settings="default", pool="threads",
                concurrency=CONDUIT_THREADS, beat_in_worker=True,
            )
        )  # fmt: skip
    return found


def build(
    sizes: Sizes,
    with_phd: bool,
    only: list[str],
    brokers: tuple[str, ...] = BROKERS,
) -> list[Scenario]:
    """Every scenario in running order (references and ceilings first, issue 21's last),
    filtered; ``brokers`` are those this machine has. Without a Phorge checkout
    (``with_phd`` false) neither phd nor the PHP section is run."""
    scenarios = [
        Scenario(
            "ceiling-celery",
            "ceiling-celery",
            NOOP,
            sizes.ceiling,
            concurrency=sizes.ceiling_concurrency,
        ),
        Scenario("ceiling-sql", "ceiling-sql", NOOP, sizes.ceiling),
        *references("taskmaster", sizes),
        *(references("phd", sizes) if with_phd else []),
        *bridge(sizes),
        *(php(sizes) if with_phd else []),
        *issue21(sizes, with_phd, brokers),
    ]
    if only:
        scenarios = [s for s in scenarios if any(fnmatch.fnmatch(s.name, p) for p in only)]
    return scenarios

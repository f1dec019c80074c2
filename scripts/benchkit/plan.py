"""Which scenarios a run measures: each one that a figure of docs/benchmarks.md (or a page
quoting it) comes from, named for ``--only``'s globs: ``ceiling-celery|sql``,
``taskmaster|phd-<workload>-p1``, ``bridge-<default|tuned>-<workload>-<c|t><N>`` (prefork
or threads); with a Phorge checkout, phd and ``php-phd-<w>-p<N>``, ``php-runner|conduit-<w>``."""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

from benchkit.phorge import NOOP_CLASS, SEARCH_CLASS
from benchkit.runner import IO50, NOOP, SLEEP10, Workload

PHP_NOOP = Workload("noop", "no-op PHP class", "{}", task_class=NOOP_CLASS)
PHP_SEARCH = Workload("search", "PhabricatorSearchWorker on a user", (), task_class=SEARCH_CLASS)
CORES = os.cpu_count() or 1  # celery worker's default concurrency
# The bridge's: settings, workload, pool and concurrency, whether --quick runs it.
BRIDGES = [("default", NOOP, "c2", True), ("default", SLEEP10, "c4", True),
           ("default", SLEEP10, "c16", False), ("default", IO50, "t16", True),
           ("default", IO50, "t32", False), ("tuned", NOOP, "c4", True)]  # fmt: skip


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str  # ceiling-celery, ceiling-sql, taskmaster, phd, bridge, php-phd|runner|conduit
    workload: Workload
    tasks: int
    settings: str = "default"  # bridge: default or tuned (scripts/bench's TUNED_SETTINGS)
    pool: str = "prefork"
    concurrency: int = 1  # bridge: -c; taskmaster, phd: processes

    @property
    def label(self) -> str:
        deployment = f"{self.pool} -c {self.concurrency}"
        if self.kind == "bridge":
            return f"bridge {self.settings}, {deployment}"
        if self.kind in ("php-runner", "php-conduit"):
            return f"{self.kind[4:]}: bridge worker -B, {deployment}"
        if self.kind in ("taskmaster", "phd", "php-phd"):
            who = "reference taskmaster" if self.kind == "taskmaster" else "phd debug taskmaster"
            return f"{who} x{self.concurrency}"
        if self.kind == "ceiling-sql":
            return "the bridge's SQL in a loop, no Celery (ceiling)"
        return f"plain Celery, -c {self.concurrency}, acks late, prefetch 1 (ceiling)"


def build(quick: bool, with_phd: bool, only: list[str]) -> list[Scenario]:
    """Every scenario in running order, filtered by ``only``; phd and the PHP section only
    ``with_phd``; ``quick``: fewer and smaller, a smoke run."""

    def n(full: int, small: int) -> int:
        return small if quick else full

    tasks = {NOOP: n(3000, 300), SLEEP10: n(1000, 200), IO50: n(1000, 200)}
    found = [
        Scenario("ceiling-celery", "ceiling-celery", NOOP, n(4000, 1000), concurrency=4),
        Scenario("ceiling-sql", "ceiling-sql", NOOP, n(4000, 1000)),
    ]
    for kind in ("taskmaster", "phd") if with_phd else ("taskmaster",):
        found += [Scenario(f"{kind}-{w.key}-p1", kind, w, tasks[w]) for w in (NOOP, SLEEP10)]
    found.append(Scenario("taskmaster-io50-p1", "taskmaster", IO50, n(100, 40)))
    for settings, w, deploy, in_quick in BRIDGES:
        if in_quick or not quick:
            pool = "threads" if deploy[0] == "t" else "prefork"
            name = f"bridge-{settings}-{w.key}-{deploy}"
            found.append(Scenario(name, "bridge", w, tasks[w], settings, pool, int(deploy[1:])))
    if with_phd:
        for w, count in ((PHP_NOOP, n(3000, 200)), (PHP_SEARCH, n(1000, 60))):
            found += [
                Scenario(f"php-phd-{w.key}-p{p}", "php-phd", w, count, concurrency=p)
                for p in (1, 2)
            ]
            found.append(Scenario(f"php-runner-{w.key}", "php-runner", w, count, concurrency=CORES))
            name = f"php-conduit-{w.key}"
            found.append(Scenario(name, "php-conduit", w, count, pool="threads", concurrency=8))
    return [s for s in found if not only or any(fnmatch.fnmatch(s.name, p) for p in only)]

"""Which scenarios a run measures, named for ``--only``'s globs: ``ceiling-*``,
``taskmaster|phd-<workload>-p<N>``, ``bridge-<default|tuned|canary>-<workload>-<c|t><N>``
(prefork or threads; *canary*: its class shared with phd at 99.99%); with a Phorge
checkout, ``php-phd-<w>-p<N>``, ``php-runner|conduit-<w>``."""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

from benchkit.phorge import NOOP_CLASS, SEARCH_CLASS
from benchkit.runner import IO50, NOOP, SLEEP10, Workload

PHP_NOOP = Workload("noop", "no-op PHP class", {}, task_class=NOOP_CLASS)
PHP_SEARCH = Workload("search", "PhabricatorSearchWorker on a user", {}, task_class=SEARCH_CLASS)
CORES = os.cpu_count() or 1  # celery worker's default concurrency


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str  # ceiling-celery, ceiling-sql, taskmaster, phd, bridge, php-phd|runner|conduit
    workload: Workload
    tasks: int
    light: int = 0  # light-load latency samples
    settings: str = "default"  # bridge: default, tuned, or canary (default, its class shared)
    pool: str = "prefork"
    concurrency: int = 1  # bridge: -c; taskmaster, phd: processes

    @property
    def label(self) -> str:
        if self.kind in ("bridge", "php-runner", "php-conduit"):
            beat = ", worker -B" if self.kind != "bridge" else ""
            return f"bridge {self.settings}{beat}, {self.pool} -c {self.concurrency}"
        if self.kind in ("taskmaster", "phd", "php-phd"):
            who = "reference taskmaster" if self.kind == "taskmaster" else "phd debug taskmaster"
            return f"{who} x{self.concurrency}"
        return "the bridge's SQL loop (ceiling)" if self.kind == "ceiling-sql" else self.name


def build(quick: bool, with_phd: bool, only: list[str]) -> list[Scenario]:
    """Every scenario in running order, filtered by ``only``; phd and the PHP section only
    ``with_phd``."""

    def n(full: int, small: int) -> int:
        return small if quick else full

    noop, sleep10, io50, light = n(3000, 300), n(1000, 200), n(1000, 200), n(30, 10)
    found = [
        Scenario("ceiling-celery", "ceiling-celery", NOOP, n(4000, 1000), concurrency=4),
        Scenario("ceiling-sql", "ceiling-sql", NOOP, n(4000, 1000)),
    ]
    for kind in ("taskmaster", "phd") if with_phd else ("taskmaster",):
        for p in (1,) if quick else (1, 2):
            sampled = light if p == 1 else 0
            found.append(Scenario(f"{kind}-noop-p{p}", kind, NOOP, noop, sampled, concurrency=p))
        found.append(Scenario(f"{kind}-10ms-p1", kind, SLEEP10, sleep10, concurrency=1))
    found.append(Scenario("taskmaster-io50-p1", "taskmaster", IO50, n(100, 40)))
    first, tuned = (2, 2) if quick else (1, 4)
    bridges = [("default", "c", c, NOOP, noop) for c in ((2,) if quick else (1, 2, 4))]
    bridges += [] if quick else [("default", "t", 4, NOOP, noop)]
    bridges += [("default", "c", c, SLEEP10, sleep10) for c in ((4,) if quick else (4, 16))]
    bridges += [("default", "t", t, IO50, io50) for t in ((16,) if quick else (16, 32))]
    bridges += [("tuned", "c", tuned, NOOP, noop)]
    # Issue 28's cost of the weights: beside bridge-default-noop-c2, its class shared.
    bridges += [("canary", "c", 2, NOOP, noop)]
    for settings, letter, c, w, tasks in bridges:
        sampled = w == NOOP and letter == "c" and c == (tuned if settings == "tuned" else first)
        pool = "threads" if letter == "t" else "prefork"
        name = f"bridge-{settings}-{w.key}-{letter}{c}"
        found.append(Scenario(name, "bridge", w, tasks, light if sampled else 0, settings, pool, c))
    if with_phd:
        for w, tasks in ((PHP_NOOP, n(3000, 200)), (PHP_SEARCH, n(1000, 60))):
            found += [
                Scenario(f"php-phd-{w.key}-p{p}", "php-phd", w, tasks, concurrency=p)
                for p in (1, 2)
            ]
            found.append(Scenario(f"php-runner-{w.key}", "php-runner", w, tasks, concurrency=CORES))
            name = f"php-conduit-{w.key}"
            found.append(Scenario(name, "php-conduit", w, tasks, pool="threads", concurrency=8))
    return [s for s in found if not only or any(fnmatch.fnmatch(s.name, p) for p in only)]

"""``scripts/bench --guard-cost``: what the canary's readers cost with a day of
1,000,000 archive rows over 50 classes, a third of them one busy class, on the bench's
durable MariaDB with Phorge's schema unchanged.

Timed, each as its user meets it: the guard's first evaluation in a process (the
ledger sums the shared classes' day once and reads their short windows' rows), its
later evaluations while the classes keep archiving (100 rows a second; the ledger reads
only the rows since, ``canary.short_window``), a scrape of the canary gauges (each
window read afresh), and ``canary report --since 24h``. Wall time and this process's
CPU time, median of the repeats.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import MySQLdb
from sqlalchemy import create_engine

from benchkit import phorgedb
from bridge.canary.guard import Suspicions, guard_once, summed_window
from bridge.canary.ledger import Ledger
from bridge.canary.store import CanaryStore
from bridge.config import load_settings
from bridge.metrics.canary import CanaryCollector

ROWS, CLASSES, DAY = 1_000_000, 50, 86_400
BUSY = "BusyWorker"  # a third of the rows: 3.9 tasks a second all day
SHARED = [BUSY, "Class1", "Class2", "Class3"]  # 20% to a native handler
LIVE_ROWS = 100  # archived between two timed evaluations, as at 100 tasks/s
OWNER = "CONCAT('bridge:', IF(MOD(seq, 5) = 0, 'native', 'runner'), ':100:1700000000:bench:1')"
FILL = (
    "INSERT INTO worker_archivetask (id, taskClass, leaseOwner, leaseExpires, failureCount,"
    " dataID, result, duration, dateCreated, dateModified, priority, archivedEpoch)"
    f" SELECT seq + %s, IF(MOD(seq, 3) = 0, '{BUSY}', CONCAT('Class', MOD(seq, {CLASSES - 1}))),"
    f" {OWNER}, 0, IF(MOD(seq, 97) = 0, 1, 0), seq, IF(MOD(seq, 101) = 0, 1, 0),"
    " 10000 + MOD(seq, 5000),"
    " @start + seq * %s DIV %s, @start + seq * %s DIV %s, 3000, NULL FROM seq_1_to_{rows}"
)


def fill(conn: MySQLdb.Connection, first_id: int, rows: int, seconds: int) -> None:
    """``rows`` archive rows spread evenly over the last ``seconds``, ids from ``first_id``."""
    cur = conn.cursor()
    cur.execute(f"SET @start = UNIX_TIMESTAMP() - {seconds}")
    cur.execute(FILL.format(rows=rows), (first_id, seconds, rows, seconds, rows))


def timed(action: Callable[[], object], repeats: int, between: Callable[[], None]) -> str:
    walls, cpus = [], []
    for _ in range(repeats):
        between()
        wall, cpu = time.perf_counter(), time.process_time()
        action()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return f"{statistics.median(walls) * 1000:.1f} ms | {statistics.median(cpus) * 1000:.1f} ms"


def run(conn: MySQLdb.Connection, url: str, ddl: Path, config_ddl: Path) -> str:
    """The report's table, measured on the bench's server (``conn``, ``url``)."""
    phorgedb.create_tables(conn, ddl)
    phorgedb.set_canary(conn, config_ddl, {name: {"python": 20} for name in SHARED})
    fill(conn, 0, ROWS, DAY)
    engine = create_engine(url)
    settings = load_settings({"BRIDGE_DATABASE_URL": url})
    store = CanaryStore.for_settings(engine, settings)
    ids = iter(range(ROWS + 1, 10**9, LIVE_ROWS))

    def archive() -> None:
        fill(conn, next(ids), LIVE_ROWS, 1)
        time.sleep(1)  # a second later, as beat sends the guard

    def first() -> None:
        guard_once(store, engine, settings, Suspicions(3), Ledger(settings.canary_history))

    ledger, suspicions = Ledger(settings.canary_history), Suspicions(3)
    guard_once(store, engine, settings, suspicions, ledger)
    collector = CanaryCollector.for_settings(engine, settings)
    rows = [
        ("guard, first evaluation (sums the day)", timed(first, 3, lambda: None)),
        (
            "guard, each later evaluation",
            timed(lambda: guard_once(store, engine, settings, suspicions, ledger), 10, archive),
        ),
        ("scrape of the canary gauges", timed(lambda: list(collector.collect()), 5, archive)),
        (
            f"canary report {BUSY} --since 24h",
            timed(lambda: summed_window(engine, BUSY, "native", DAY), 3, lambda: None),
        ),
    ]
    engine.dispose()
    lines = [
        f"Canary readers with {ROWS:,} archive rows over a day, {CLASSES} classes, "
        f"{len(SHARED)} shared ({json.dumps(SHARED)}), a third of the rows {BUSY}'s:",
        "",
        "| reader | wall (median) | CPU of this process |",
        "|---|---|---|",
    ]
    return "\n".join([*lines, *(f"| {name} | {figures} |" for name, figures in rows)]) + "\n"

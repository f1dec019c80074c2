"""``scripts/bench``: set up, run the plan scenario by scenario, write the report.

Every resource enters one ``ExitStack`` as it is made and every consumer stops in a
``finally``: all is removed on the way out, also on an error, Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import ExitStack
from dataclasses import replace
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import MySQLdb

from benchkit import guard_cost, mariadb, phorge, phorgedb, plan, rabbit, runner
from benchkit.consumers import REPO, Bridge, Consumer, Phd, ReferenceTaskmaster, SqlLoop
from benchkit.plan import Scenario
from benchkit.procs import BenchError
from benchkit.report import Report, Result

DDL = REPO / "tests" / "reference" / "phorge-worker-schema.sql"
CONFIG_DDL = REPO / "tests" / "reference" / "phorge-config-schema.sql"
STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


def private_server(stack: ExitStack, port: int) -> tuple[mariadb.Server, MySQLdb.Connection, Path]:
    """The bench's durable MariaDB in a scratch directory, both gone with ``stack``."""
    scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bridge-bench-")))
    log(f"starting a durable MariaDB on 127.0.0.1:{port}")
    server = stack.enter_context(mariadb.private_server(port, scratch))
    conn = server.connect()
    stack.callback(conn.close)
    return server, conn, scratch


class Bench:
    """The shared pieces, and one scenario's run."""

    def __init__(self, stack: ExitStack, port: int, tuned: dict[str, str], php: bool) -> None:
        self.tuned, self.notes = tuned, []
        self.server, self.conn, self.scratch = private_server(stack, port)
        self.broker = stack.enter_context(rabbit.broker(REPO, log))
        self.phorge: phorge.Install | None = None
        self.phorge_error = "no PHORGE_ROOT"
        if php:
            try:
                setup = (self.server, self.conn, self.scratch, log)
                self.phorge = phorge.install(Path(os.environ["PHORGE_ROOT"]), *setup)
                self.notes += self.phorge.notes
            except (BenchError, OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
                self.phorge_error = str(exc)
                log(f"Phorge set-up failed, phd and the PHP section are reported as not run: {exc}")
        phorgedb.create_tables(self.conn, DDL)  # after Phorge's: making users queues rows
        phorgedb.set_canary(self.conn, CONFIG_DDL, None)  # the bridge reads it: no weights
        self.runner = runner.Runner(self.conn, self.server.proc.pid)

    def consumer(self, s: Scenario) -> Consumer:
        name, scratch, server = s.name, self.scratch, self.server
        if s.kind == "taskmaster":
            return ReferenceTaskmaster(name, scratch, server=server, processes=s.concurrency)
        if s.kind == "ceiling-sql":
            return SqlLoop(name, scratch, server=server, broker=self.broker)
        if s.kind != "bridge" and self.phorge is None:
            raise BenchError(f"not run: {self.phorge_error.splitlines()[0]}")
        if s.kind in ("phd", "php-phd"):
            assert self.phorge
            root, env = self.phorge.root, self.phorge.env
            return Phd(name, scratch, root=root, env=env, processes=s.concurrency)
        settings, web = self.tuned if s.settings == "tuned" else {}, None
        if self.phorge and s.kind == "php-runner":
            settings = {"BRIDGE_PHORGE_ROOT": str(self.phorge.root)}
        if self.phorge and s.kind == "php-conduit":
            settings, web = {"BRIDGE_CONDUIT_TOKEN": self.phorge.token}, self.phorge.root
        beat = s.kind != "bridge"  # the PHP section's: the README's worker -B
        return Bridge(name, scratch, server=server, broker=self.broker, settings=settings,
                      pool=s.pool, concurrency=s.concurrency, beat_in_worker=beat,
                      web_root=web)  # fmt: skip

    def run(self, s: Scenario) -> Result:
        """One scenario; any error becomes the result's ``error``, for the report."""
        result, started = Result(s), time.monotonic()
        log(f"{s.name}: {s.tasks} tasks ({s.workload.label})")
        try:
            if s.kind == "ceiling-celery":
                args = (self.broker, self.scratch, s.tasks, s.concurrency)
                result.throughput = runner.plain_celery(*args)
            else:
                result.throughput = self.measure(s)
        except (BenchError, MySQLdb.Error) as exc:
            result.error = str(exc)
        except Exception as exc:
            result.error = f"{exc!r}\n{traceback.format_exc(limit=-3)}"
        rate = f"{result.rate:,.0f} tasks/s" if result.rate else "no rate"
        rate = "FAILED: " + result.error.splitlines()[0][:200] if result.error else rate
        log(f"{s.name}: {rate} ({time.monotonic() - started:.0f} s)")
        return result

    def measure(self, s: Scenario) -> runner.Throughput:
        phorgedb.truncate(self.conn)
        workload = s.workload
        if workload.task_class == phorge.SEARCH_CLASS and self.phorge:
            workload = replace(workload, data=phorge.search_data(self.phorge.documents))
        consumer = self.consumer(s)
        try:
            consumer.start()
            if s.kind != "ceiling-sql":  # the loop runs one batch only
                php = s.kind.startswith("php-")
                self.runner.warm_up(consumer, workload, max(32 if php else 10, 2 * s.concurrency))
            t = self.runner.throughput(consumer, workload, s.tasks)
            if isinstance(consumer, Bridge) and consumer.web:
                t.web_requests = consumer.web.accepted() - consumer.requests_at_release
            return t
        except BenchError as exc:
            raise BenchError(f"{exc}{consumer.log_tails()}") from None
        finally:
            consumer.stop()


def facts(conn: MySQLdb.Connection) -> dict[str, str]:
    """What the figures were measured on."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    info = dict(line.split(":", 1) for line in lines if ":" in line)
    memory = int(Path("/proc/meminfo").read_text().split()[1]) / 1024**2  # MemTotal, kB
    cur = conn.cursor()
    cur.execute("SELECT VERSION()")
    found = {"CPU": info.get("model name\t", "?").strip(), "cores": str(os.cpu_count()),
             "RAM": f"{memory:.1f} GiB", "kernel": platform.release(),
             "Python": platform.python_version(), "MariaDB": cur.fetchone()[0],
             "RabbitMQ": rabbit.version() or "unknown (no answer)"}  # fmt: skip
    for name in ("celery", "kombu", "SQLAlchemy", "mysqlclient"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    git = ["git", "-C", str(REPO), "describe", "--always", "--dirty"]
    found["phorge-bridge"] = subprocess.run(git, capture_output=True, text=True).stdout.strip()
    return found | {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}


def run_all(scenarios: list[Scenario], port: int, tuned: dict[str, str]) -> tuple[str, bool]:
    """The report, and whether any scenario failed."""
    with ExitStack() as stack:
        php = any(s.kind == "phd" or s.kind.startswith("php-") for s in scenarios)
        bench = Bench(stack, port, tuned, php and "PHORGE_ROOT" in os.environ)
        results = [bench.run(s) for s in scenarios]
        settings = ", ".join(f"`{k}={v}`" for k, v in tuned.items())
        notes = [
            "MariaDB: private, durable (innodb_flush_log_at_trx_commit=1, doublewrite on).",
            f"bridge *default*: only the two URLs; *tuned*: plus {settings}. Each run: `celery "
            "-A bridge beat` plus ONE `celery -A bridge worker -Q bridge.control,phorge`; the "
            "PHP section's ONE `worker -B`. Each consumer is warmed up with a small batch first.",
            *bench.notes,
            f"whole bench: {(time.monotonic() - STARTED) / 60:.1f} min.",
        ]
        text = Report(results, facts(bench.conn), notes).render()
        log("stopping the servers")
    return text, any(r.error or (r.throughput and r.throughput.problems) for r in results)


def guard_costs(port: int) -> str:
    """``--guard-cost``: the canary readers on the bench's durable MariaDB alone."""
    with ExitStack() as stack:
        server, conn, _ = private_server(stack, port)
        return guard_cost.run(conn, server.url(phorgedb.DATABASE), DDL, CONFIG_DDL)


def interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(tuned: dict[str, str], argv: list[str] | None = None) -> int:
    what = "The bridge next to a reference taskmaster, phd and two ceilings (docs/benchmarks.md)."
    parser = argparse.ArgumentParser(prog="scripts/bench", description=what)
    add = parser.add_argument
    add("--out", default="bench-report.md", help="the report's file (bench-report.md)")
    add("--port", type=int, default=3309, help="the bench's MariaDB's port (3309)")
    add("--quick", action="store_true", help="fewer tasks and deployments: a smoke run")
    add("--only", default="", help="comma-separated globs of scenario names (see --list)")
    add("--list", action="store_true", help="print the scenario names and exit")
    add("--guard-cost", action="store_true", help="only the canary readers' cost at 1M rows")
    args = parser.parse_args(argv)
    only = [p.strip() for p in args.only.split(",") if p.strip()]
    scenarios = plan.build(args.quick, bool(os.environ.get("PHORGE_ROOT")), only)
    if not args.guard_cost and (args.list or not scenarios):
        print("\n".join(s.name for s in scenarios) or "no scenario matches --only")
        return 0 if scenarios else 2
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupt)
    try:
        failed = False
        if args.guard_cost:
            text = guard_costs(args.port)
        else:
            text, failed = run_all(scenarios, args.port, tuned)
    except KeyboardInterrupt:
        log("interrupted: everything the bench started has been stopped and removed")
        return 130
    Path(args.out).write_text(text)
    print(text)
    log(f"report written to {args.out}")
    return int(failed)

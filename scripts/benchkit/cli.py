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

from benchkit import (
    consumers,
    guard_cost,
    mariadb,
    phorge,
    phorgedb,
    plan,
    procs,
    rabbit,
    runner,
)
from benchkit.consumers import REPO, Bridge, Consumer, Phd, ReferenceTaskmaster, SqlLoop
from benchkit.plan import Scenario
from benchkit.procs import BenchError
from benchkit.report import Report, Result

DDL = REPO / "tests" / "reference" / "phorge-worker-schema.sql"
CONFIG_DDL = REPO / "tests" / "reference" / "phorge-config-schema.sql"
CANARY_WEIGHT = 9999  # basis points: the bridge's share of the canary scenario's class
STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


class Bench:
    """The shared pieces, and one scenario's run."""

    def __init__(
        self, stack: ExitStack, args: argparse.Namespace, tuned: dict[str, str], notes: list[str]
    ) -> None:
        self.tuned = tuned
        scratch = tempfile.TemporaryDirectory(prefix="bridge-bench-")
        self.scratch = Path(stack.enter_context(scratch))
        self.broker = stack.enter_context(rabbit.broker(REPO, log))
        log(f"starting a durable MariaDB on 127.0.0.1:{args.port}")
        self.server = stack.enter_context(mariadb.private_server(args.port, self.scratch))
        self.conn = self.server.connect()
        stack.callback(self.conn.close)
        self.phorge: phorge.Install | None = None
        self.phorge_error = "no PHORGE_ROOT"
        root = os.environ.get("PHORGE_ROOT")
        scenarios = plan.build(args.quick, bool(root), args.only)
        if root and any("phd" in s.kind or s.kind.startswith("php-") for s in scenarios):
            try:
                setup = (self.server, self.conn, self.scratch, log, args.web_port)
                install = stack.enter_context(phorge.install(Path(root), *setup))
                if any(s.kind.startswith("php-") for s in scenarios):
                    # Before the queue tables are recreated: making users queues rows.
                    install = stack.enter_context(phorge.prepare(install, log))
                self.phorge = install
                notes += install.notes
            except (BenchError, OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
                self.phorge_error = str(exc)
                log(f"Phorge set-up failed, phd and the PHP section are reported as not run: {exc}")
        phorgedb.create_tables(self.conn, DDL)
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
        overrides, web = self.tuned if s.settings == "tuned" else {}, {}
        if self.phorge and s.kind == "php-runner":
            overrides = {"BRIDGE_PHORGE_ROOT": str(self.phorge.root)}
        if self.phorge and s.kind == "php-conduit":
            overrides = {"BRIDGE_CONDUIT_TOKEN": self.phorge.token}
            web = {"web_root": self.phorge.root, "web_port": self.phorge.web_port}
        beat = s.kind != "bridge"  # the PHP section's: the README's worker -B
        deployment = {"pool": s.pool, "concurrency": s.concurrency, "beat_in_worker": beat}
        return Bridge(name, scratch, server=server, broker=self.broker, overrides=overrides,
                      **deployment, **web)  # fmt: skip

    def run(self, s: Scenario) -> Result:
        """One scenario; any error becomes the result's ``error``, for the report."""
        result, started = Result(s), time.monotonic()
        log(f"{s.name}: {s.tasks} tasks ({s.workload.label})")
        try:
            if s.kind == "ceiling-celery":
                args = (self.broker, self.scratch, s.tasks, s.concurrency)
                result.ceiling = consumers.plain_celery(*args)
            else:
                self.measure(s, result)
        except (BenchError, MySQLdb.Error) as exc:
            result.error = str(exc)
        except Exception as exc:
            result.error = f"{exc!r}\n{traceback.format_exc(limit=-3)}"
        rate = f"{result.rate:,.0f} tasks/s" if result.rate else "no rate"
        rate = "FAILED: " + result.error.splitlines()[0][:200] if result.error else rate
        log(f"{s.name}: {rate} ({time.monotonic() - started:.0f} s)")
        return result

    def measure(self, s: Scenario, result: Result) -> None:
        phorgedb.truncate(self.conn)
        shared = s.settings == "canary"
        weights = {s.workload.task_class: {"celery": CANARY_WEIGHT / 100}} if shared else None
        phorgedb.set_canary(self.conn, CONFIG_DDL, weights)
        self.runner.phds_share = CANARY_WEIGHT if shared else None
        php = s.kind.startswith("php-")
        workload = s.workload
        if workload.task_class == phorge.SEARCH_CLASS and self.phorge:
            workload = replace(workload, variants=phorge.search_data(self.phorge.documents))
        consumer = self.consumer(s)
        try:
            consumer.start()
            if s.kind != "ceiling-sql":  # the loop runs one batch only
                self.runner.warm_up(consumer, workload, max(32 if php else 10, 2 * s.concurrency))
            if s.light:
                result.light = self.runner.light(consumer, s.workload, s.light)
            result.throughput = t = self.runner.throughput(consumer, workload, s.tasks)
            if isinstance(consumer, Bridge) and consumer.web:
                t.web_requests = consumer.web.accepted() - consumer.requests_at_release
        except BenchError as exc:
            raise BenchError(f"{exc}{consumer.log_tails()}") from None
        finally:
            consumer.stop()
            if isinstance(consumer, Bridge) and consumer.web:
                result.opcache = consumer.opcache


def facts(conn: MySQLdb.Connection) -> dict[str, str]:
    """What the figures were measured on."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    info = dict(line.split(":", 1) for line in lines if ":" in line)
    memory = int(Path("/proc/meminfo").read_text().split()[1]) / 1024**2  # MemTotal, kB
    cur = conn.cursor()
    cur.execute("SELECT VERSION()")
    found = {"CPU": info.get("model name\t", "?").strip(), "cores": str(os.cpu_count()),
             "RAM": f"{memory:.1f} GiB", "kernel": platform.release(),
             "Python": platform.python_version(), "MariaDB": cur.fetchone()[0]}  # fmt: skip
    found["RabbitMQ"] = rabbit.version() or "unknown (no answer)"
    for name in ("celery", "kombu", "SQLAlchemy", "mysqlclient"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    git = ["git", "-C", str(REPO), "describe", "--always", "--dirty"]
    found["phorge-bridge"] = subprocess.run(git, capture_output=True, text=True).stdout.strip()
    return found | {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}


def guard_costs(args: argparse.Namespace) -> int:
    """``--guard-cost``: the canary readers on the bench's durable MariaDB alone."""
    with ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bridge-bench-")))
        log(f"starting a durable MariaDB on 127.0.0.1:{args.port}")
        server = stack.enter_context(mariadb.private_server(args.port, scratch))
        conn = server.connect()
        stack.callback(conn.close)
        text = guard_cost.run(conn, server.url(phorgedb.DATABASE), DDL, CONFIG_DDL)
    Path(args.out).write_text(text)
    print(text)
    return 0


def interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(tuned: dict[str, str], argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--out", default="bench-report.md", help="the report's file (bench-report.md)")
    add("--port", type=int, default=3309, help="the bench's MariaDB's port (3309)")
    add("--web-port", type=int, default=phorge.WEB_PORT, help="the PHP section's php -S (8799)")
    add("--quick", action="store_true", help="fewer tasks and deployments: a smoke run")
    add("--only", default="", help="comma-separated globs of scenario names (see --list)")
    add("--list", action="store_true", help="print the scenario names and exit")
    add("--guard-cost", action="store_true", help="only the canary readers' cost at 1M rows")
    args = parser.parse_args(argv)
    if args.guard_cost:
        return guard_costs(args)
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    scenarios = plan.build(args.quick, bool(os.environ.get("PHORGE_ROOT")), args.only)
    if args.list or not scenarios:
        print("\n".join(s.name for s in scenarios) or "no scenario matches --only")
        return 0 if scenarios else 2
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupt)
    settings = ", ".join(f"`{k}={v}`" for k, v in tuned.items())
    notes = [
        f"machine CPU busy in the 3 s before the bench: {procs.busy_share(3.0):.0%}.",
        "MariaDB: private, durable (innodb_flush_log_at_trx_commit=1, doublewrite on).",
        f"bridge *default*: only the two URLs; *tuned*: plus {settings}; *canary*: default, "
        "its class shared with phd at 99.99% (`phorge-bridge.canary`; the bench archives "
        "phd's share itself). Each run: `celery -A "
        "bridge beat` plus ONE `celery -A bridge worker -Q bridge.control,phorge`; the PHP "
        "section's ONE `worker -B`. Each consumer is warmed up with a small batch first.",
    ]
    try:
        with ExitStack() as stack:
            bench = Bench(stack, args, tuned, notes)
            results = [bench.run(s) for s in scenarios]
            found = facts(bench.conn)
            notes.append(f"whole bench: {(time.monotonic() - STARTED) / 60:.1f} min.")
            log("stopping the servers")
    except KeyboardInterrupt:
        log("interrupted: everything the bench started has been stopped and removed")
        return 130
    text = Report(results, found, notes).render()
    Path(args.out).write_text(text)
    print(text)
    log(f"report written to {args.out}")
    return 1 if any(r.error or (r.throughput and r.throughput.problems) for r in results) else 0

"""``scripts/bench``: set everything up, run the plan scenario by scenario, write the report.

Everything started is stopped and every temporary directory removed on the way out,
also on an error, Ctrl-C or SIGTERM: each resource is entered into one ``ExitStack``
as soon as it exists, and each consumer is stopped in a ``finally``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import MySQLdb

from benchkit import (
    brokers,
    ceilings,
    machine,
    mariadb,
    phorge,
    phorgedb,
    php,
    plan,
    priority,
    procs,
    rabbit,
    unserved,
    webtier,
)
from benchkit.consumers import REPO, Bridge, Consumer, Phd, ReferenceTaskmaster
from benchkit.phpconsumers import ConduitBridge, PhpPhd, RunnerBridge
from benchkit.plan import Scenario, Sizes
from benchkit.procs import BenchError
from benchkit.rabbit import Broker
from benchkit.report import Context, Report, Result, number
from benchkit.runner import NOOP, Runner, Throughput

DDL = REPO / "tests" / "reference" / "phorge-worker-schema.sql"
PHP_WARM_UP = 32  # tasks before a PHP-section run: every runner process and web worker warm
# Before each PHP-section run, wait (at most QUIET_TIMEOUT s) for a second with the
# machine at most this busy: its runs are short, and one burst of other work moves them.
QUIET_BUSY, QUIET_TIMEOUT = 0.15, 60.0


class Log:
    """Progress lines on stderr, stamped with the time since the bench started."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/bench",
        description="Benchmark the bridge against Phorge's own taskmaster and two ceilings.",
    )
    parser.add_argument("--out", default="bench-report.md", help="report file (bench-report.md)")
    parser.add_argument("--port", type=int, default=3309, help="port of the bench's MariaDB")
    parser.add_argument(
        "--redis-port", type=int, default=6390, help="port of the bench's Redis (6390)"
    )
    parser.add_argument(
        "--web-port",
        type=int,
        default=phorge.WEB_PORT,
        help=f"port of the PHP section's web tier, php -S ({phorge.WEB_PORT})",
    )
    parser.add_argument("--quick", action="store_true", help="few tasks, fewer scenarios")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated globs of scenario names, e.g. 'bridge-tuned-*,taskmaster-*' "
        "(--list shows the names)",
    )
    parser.add_argument("--list", action="store_true", help="print the scenario names and exit")
    return parser.parse_args(argv)


@dataclass
class Bench:
    """The shared pieces every scenario uses."""

    scratch: Path
    server: mariadb.Server
    broker: Broker
    conn: MySQLdb.Connection
    runner: Runner
    tuned: dict[str, str]
    log: Log
    sizes: Sizes
    phd_env: dict[str, str] | None = None
    phorge_root: Path | None = None
    phd_error: str = ""
    redis: Broker | None = None  # the bench's own Redis, if installed and needed
    php_setup: php.PhpSetup | None = None  # the PHP section's Phorge (issue 19)
    php_error: str = ""

    def broker_for(self, s: Scenario) -> Broker:
        """The scenario's broker: RabbitMQ, the bench's Redis or a new SQLite file."""
        if s.broker == plan.SQLITE:
            return brokers.sqlite(self.scratch)
        if s.broker == plan.REDIS:
            if self.redis is None:
                raise BenchError("the bench's Redis did not start (see the log)")
            return self.redis
        return self.broker

    def consumer(self, s: Scenario) -> Consumer:
        name = s.name
        if s.kind == "bridge":
            overrides = self.tuned if s.settings == "tuned" else {}
            return Bridge(
                name, self.scratch, server=self.server, broker=self.broker_for(s),
                overrides=overrides, pool=s.pool, concurrency=s.concurrency,
                beat_in_worker=s.beat_in_worker, own_queues=s.workload.measure == "priority",
            )  # fmt: skip
        if s.kind == "taskmaster":
            return ReferenceTaskmaster(
                name, self.scratch, server=self.server, processes=s.concurrency
            )
        if s.kind == "phd":
            if self.phd_env is None or self.phorge_root is None:
                raise BenchError(f"phd not run: {self.phd_error}")
            return Phd(
                name, self.scratch, phorge_root=self.phorge_root, env=self.phd_env,
                processes=s.concurrency,
            )  # fmt: skip
        if s.kind == "ceiling-sql":
            return ceilings.SqlLoop(name, self.scratch, server=self.server, broker=self.broker)
        if s.kind in plan.PHP_KINDS:
            return self.php_consumer(s)
        raise ValueError(s.kind)

    def php_consumer(self, s: Scenario) -> Consumer:
        """The PHP section's consumers, all on the copy ``php.prepare`` set up."""
        setup = self.php_setup
        if setup is None:
            raise BenchError(f"PHP section not run: {self.php_error or self.phd_error}")
        if s.kind == "php-phd":
            return PhpPhd(
                s.name, self.scratch, phorge_root=setup.root, env=setup.env,
                processes=s.concurrency,
            )  # fmt: skip
        kind = RunnerBridge if s.kind == "php-runner" else ConduitBridge
        return kind(
            s.name, self.scratch, server=self.server, broker=self.broker, pool=s.pool,
            concurrency=s.concurrency, beat_in_worker=True, setup=setup,
        )  # fmt: skip

    def run(self, s: Scenario) -> Result:
        """One scenario; any error becomes the result's ``error``, for the report."""
        result = Result(s)
        started = time.monotonic()
        self.log(f"{s.name}: {s.tasks} tasks ({s.workload.label})")
        try:
            if s.kind == "ceiling-celery":
                result.ceiling = ceilings.plain_celery(
                    self.broker, self.scratch, s.tasks, s.concurrency
                )
            else:
                self.measure(s, result)
        except (BenchError, MySQLdb.Error) as exc:
            result.error = str(exc)
        except Exception as exc:
            result.error = f"{exc!r}\n{traceback.format_exc(limit=-3)}"
        result.wall = time.monotonic() - started
        self.log(f"{s.name}: {summary(result)} ({result.wall:.0f} s)")
        return result

    def measure(self, s: Scenario, result: Result) -> None:
        phorgedb.truncate(self.conn)
        if s.kind in plan.PHP_KINDS:
            self.measure_php(s, result)
            return
        consumer = self.consumer(s)
        try:
            consumer.start()
            warm_up = s.workload if s.workload.measure == "throughput" else NOOP
            if s.kind != "ceiling-sql":  # the loop warms itself and runs one batch only
                self.runner.warm_up(consumer, warm_up, max(10, 2 * s.concurrency))
            if s.light:
                result.light = self.runner.light(consumer, s.workload, s.light)
            if s.workload.measure == "priority":
                result.priority = priority.run(self.conn, consumer, s.workload, s.tasks, self.log)
            elif s.workload.measure == "unserved":
                result.unserved = unserved.run(
                    self.conn, self.runner, consumer, s.workload, s.tasks, self.sizes.unserved,
                    self.log,
                )  # fmt: skip
            else:
                result.throughput = self.runner.throughput(consumer, s.workload, s.tasks)
        except BenchError as exc:
            raise BenchError(f"{exc}{consumer.diagnose()}{consumer.log_tails()}") from None
        finally:
            consumer.stop()

    def measure_php(self, s: Scenario, result: Result) -> None:
        """A PHP-section run: warmed up on its own PHP-only class (which proves the class
        is found and the path to PHP works), then a drain, with pings for the ping run."""
        busy, waited = procs.wait_quiet(QUIET_BUSY, timeout=QUIET_TIMEOUT)
        if waited > 1.5:
            self.log(f"{s.name}: waited {waited:.0f} s for a quiet machine ({busy:.0%} busy)")
        consumer = self.consumer(s)
        assert self.php_setup is not None
        workload = self.php_setup.resolve(s.workload)
        try:
            consumer.start()
            self.runner.warm_up(consumer, workload, max(PHP_WARM_UP, 2 * s.concurrency))
            if s.workload.measure == "ping" and isinstance(consumer, ConduitBridge):
                web = consumer.web
                assert web is not None

                def drain(begin: Callable[[], None]) -> Throughput:
                    consumer.on_released = begin
                    return self.runner.throughput(consumer, workload, s.tasks)

                result.ping, result.throughput = webtier.ping_during(
                    web.url, self.sizes.php_ping_idle, drain
                )
            else:
                result.throughput = self.runner.throughput(consumer, workload, s.tasks)
            if isinstance(consumer, ConduitBridge):
                pinged = len(result.ping.during) if result.ping else 0
                served = consumer.web_requests() - consumer.requests_at_release
                result.web_requests = served - pinged
        except BenchError as exc:
            raise BenchError(f"{exc}{consumer.diagnose()}{consumer.log_tails()}") from None
        finally:
            consumer.stop()
            if isinstance(consumer, ConduitBridge) and consumer.web is not None:
                result.opcache = {"start": consumer.web.opcache, "end": consumer.opcache_after}


def summary(result: Result) -> str:
    if result.error:
        return "FAILED: " + result.error.splitlines()[0][:200]
    problems = result.problems
    if problems:
        return "FAILED: " + "; ".join(problems)
    if result.priority and result.priority.to_archive:
        spread = result.priority.to_archive
        return f"urgent enqueue to archive p50 {spread.p50:.2f} s, max {spread.max:.2f} s"
    if result.unserved:
        run = result.unserved
        return (
            f"{run.behind.rate:,.0f} tasks/s behind, {run.alone.rate:,.0f} alone ({run.ratio:.2f}x)"
        )
    if result.ping and result.ping.ratio is not None:
        idle, during = result.ping.idle_p, result.ping.during_p
        assert idle is not None and during is not None
        return (
            f"{number(result.rate)} tasks/s; conduit.ping p95 {idle.p95 * 1000:.0f} ms idle, "
            f"{during.p95 * 1000:.0f} ms during the drain ({result.ping.ratio:.2f}x)"
        )
    return f"{result.rate:,.0f} tasks/s" if result.rate else "no figure"


def raise_interrupt(signum: int, _frame: Any) -> None:
    """SIGTERM/SIGHUP clean up like Ctrl-C does."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(tuned: dict[str, str], argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = plan.QUICK if args.quick else Sizes()
    root = os.environ.get("PHORGE_ROOT")  # a Phorge checkout with arcanist beside it: phd too
    phorge_root = Path(root).resolve() if root else None
    only = [p.strip() for p in args.only.split(",") if p.strip()]
    available = tuple(b for b in plan.BROKERS if b != plan.REDIS or brokers.redis_installed())
    scenarios = plan.build(sizes, phorge_root is not None, only, available)
    if args.list or not scenarios:
        print("\n".join(s.name for s in scenarios) or "no scenario matches --only")
        return 0 if scenarios else 2
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, raise_interrupt)
    log = Log()
    context = Context(facts={}, tuned=dict(tuned))
    try:
        with ExitStack() as stack:
            bench = set_up(stack, args, tuned, sizes, log, context, phorge_root, scenarios)
            results = [bench.run(s) for s in scenarios]
            context.duration = time.monotonic() - log.started
            log("stopping the servers")
    except KeyboardInterrupt:
        log("interrupted: everything the bench started has been stopped and removed")
        return 130
    text = Report(results, context).render()
    Path(args.out).write_text(text)
    print(text)
    log(f"report written to {args.out}")
    return 1 if any(summary(r).startswith("FAILED") for r in results) else 0


def quiet_check(log: Log, seconds: float = 3.0) -> str:
    """How busy the machine was just before the bench: other load skews every figure."""
    before = procs.MachineCPU.sample()
    time.sleep(seconds)
    busy = procs.MachineCPU.sample().busy_share_since(before)
    if busy > 0.15:
        log(f"WARNING: the machine is {busy:.0%} busy before the bench starts")
    return f"machine CPU busy in the {seconds:.0f} s before the bench started: {busy:.0%}."


def set_up(
    stack: ExitStack,
    args: argparse.Namespace,
    tuned: dict[str, str],
    sizes: Sizes,
    log: Log,
    context: Context,
    phorge_root: Path | None,
    scenarios: list[Scenario],
) -> Bench:
    """Start the servers (each entered into ``stack``), create the tables."""
    scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bridge-bench-")))
    context.notes.append(quiet_check(log))
    broker = stack.enter_context(rabbit.broker(REPO, log))
    if broker.vhost:
        context.notes.append(f"RabbitMQ: a private vhost per bench run ({broker.vhost}).")
    else:
        context.notes.append("RabbitMQ: default vhost; the bridge got queue names of its own.")
    log(f"starting a durable MariaDB on 127.0.0.1:{args.port}")
    server = stack.enter_context(mariadb.private_server(args.port, scratch))
    conn = server.connect()
    stack.callback(conn.close)
    redis = None
    if any(s.broker == plan.REDIS for s in scenarios):
        log(f"starting the bench's Redis on 127.0.0.1:{args.redis_port}")
        redis = stack.enter_context(brokers.private_redis(args.redis_port, scratch))
        context.notes.append(
            f"Redis: the bench's own on port {args.redis_port}, in memory (no persistence)."
        )
    phd_env, phd_error = None, ""
    setup, php_error = None, ""
    wants_php = any(s.kind in plan.PHP_KINDS for s in scenarios)
    if phorge_root and (wants_php or any(s.kind == "phd" for s in scenarios)):
        try:
            taken = webtier.free_port_error(args.web_port) if wants_php else None
            if taken:
                raise BenchError(taken)
            install = stack.enter_context(
                phorge.install(phorge_root, server, conn, scratch, log, args.web_port)
            )
            phd_env, phorge_root = install.env, install.root
            context.notes.extend(install.notes)
        except (BenchError, OSError, subprocess.SubprocessError) as exc:
            phd_error = str(exc)
            log(f"phd set-up failed, its scenarios will be reported as not run: {exc}")
            context.notes.append(f"phd: set-up failed: {phd_error.splitlines()[0]}")
        if wants_php and phd_env is not None:
            try:
                # Before the queue tables are recreated: the rows Phorge queues as the
                # users are made are dropped with them.
                setup = stack.enter_context(php.prepare(install, log))
                context.notes.extend(setup.notes)
            except (BenchError, OSError, subprocess.SubprocessError, KeyError) as exc:
                php_error = str(exc)
                log(f"PHP section set-up failed, its scenarios will be reported as not run: {exc}")
                context.notes.append(f"PHP section: set-up failed: {php_error.splitlines()[0]}")
    phorgedb.create_worker_tables(conn, DDL)
    context.notes.append(
        "MariaDB: private, durable (innodb_flush_log_at_trx_commit=1, doublewrite on), "
        "STRICT_ALL_TABLES, utf8mb4_bin; tables from tests/reference/phorge-worker-schema.sql."
    )
    context.facts = machine.describe(conn, REPO)
    runner = Runner(conn, server.proc.pid, log)
    return Bench(
        scratch, server, broker, conn, runner, tuned, log, sizes, phd_env, phorge_root,
        phd_error, redis, setup, php_error,
    )  # fmt: skip

#!/usr/bin/env python3
"""Benchmark: no-op PhabricatorTestWorker tasks through MariaDB and a real broker.

    python scripts/bench.py --tasks 5000 --workers 2 --concurrency 4

Starts ``celery beat``, one poller worker (the control queue, ``-c 1``) and
``--workers`` task workers, on a database and queues of its own; waits until they are
ready; queues every task in one transaction; and measures the wall time until all are
archived. Prints tasks per second and commits per task, counted two ways:

- client-side: every COMMIT the bridge's processes send, counted by a SQLAlchemy hook
  loaded into them (a ``sitecustomize`` on their PYTHONPATH): exact, and blind to
  whatever else runs on the server;
- server-side: the growth of MariaDB's global ``Com_commit`` and ``Handler_commit``,
  which includes any other client of the server during the run.

Everything it creates (processes, database, queues, files) is removed at the end, so
the services are left as found. The defaults point at ``scripts/services.sh``'s.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

import sqlalchemy as sa
from kombu import Connection

from bridge.model import NewTask
from bridge.queue import PhorgeQueue, make_engine
from bridge.schema import metadata
from bridge.schema import worker_activetask as active
from bridge.schema import worker_archivetask as archive

TASK_CLASS = "PhabricatorTestWorker"
READY_TIMEOUT = 60

# Loaded by every Python process of the bridge through PYTHONPATH: one byte per COMMIT,
# appended to a file per process id (prefork children included), and an empty file per
# worker once it is ready (Celery logs "ready." only at INFO, which would slow it down).
PROCESS_HOOKS = """\
import os

from celery.signals import worker_ready
from sqlalchemy import event
from sqlalchemy.engine import Engine

_DIR = os.environ["PHORGE_BRIDGE_BENCH_DIR"]
_fd = [None, None]


@event.listens_for(Engine, "commit")
def _count_commit(conn):
    if _fd[0] != os.getpid():
        path = os.path.join(_DIR, "commits", str(os.getpid()))
        _fd[:] = [os.getpid(), os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)]
    os.write(_fd[1], b"c")


@worker_ready.connect
def _ready(**_kwargs):
    open(os.path.join(_DIR, "ready", str(os.getpid())), "w").close()
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=5000, help="tasks to run (default 5000)")
    parser.add_argument("--workers", type=int, default=1, help="task worker processes")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork children each")
    parser.add_argument(
        "--broker",
        default=os.environ.get("PHORGE_BRIDGE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//"),
        help="broker URL (default: the test RabbitMQ)",
    )
    parser.add_argument(
        "--database",
        default=os.environ.get(
            "PHORGE_BRIDGE_TEST_MYSQL_URL", "mysql+mysqldb://bridge:bridge@127.0.0.1:3307"
        ),
        help="MariaDB server URL, without a database (a throwaway one is created)",
    )
    parser.add_argument("--poll-interval", default="0.2", help="BRIDGE_POLL_INTERVAL (0.2)")
    parser.add_argument("--max-inflight", default="500", help="BRIDGE_MAX_INFLIGHT (500)")
    parser.add_argument("--prefetch-multiplier", type=int, help="celery worker option")
    parser.add_argument(
        "--task-events", action="store_true", help="BRIDGE_TASK_EVENTS=true (off by default)"
    )
    return parser.parse_args()


@contextmanager
def throwaway_database(server_url: str):
    """A database holding Phorge's tables, dropped afterwards; yields its URL."""
    server = sa.create_engine(server_url)
    name = f"bridge_bench_{secrets.token_hex(4)}"
    with server.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE `{name}`")
    url = sa.make_url(server_url).set(database=name).render_as_string(hide_password=False)
    try:
        engine = make_engine(url)
        metadata.create_all(engine)
        engine.dispose()
        yield url
    finally:
        with server.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
        server.dispose()


def delete_queues(broker_url: str, names: list[str], suffix: str) -> None:
    """Delete the run's queues and exchanges (on Redis: every key naming them)."""
    with Connection(broker_url, connect_timeout=5) as conn:
        channel = conn.default_channel
        for name in names:
            channel.queue_delete(name)
            if not broker_url.startswith("redis"):
                channel.exchange_delete(name)
        if broker_url.startswith("redis"):
            for key in channel.client.scan_iter(match=f"*{suffix}*"):
                channel.client.delete(key)


class Processes:
    """Celery subprocesses, each the leader of a process group that ``stop`` kills."""

    def __init__(self, directory: Path, env: dict[str, str]) -> None:
        self.directory, self.env = directory, env
        self.started: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, *args: str) -> None:
        """Start ``celery -A bridge *args``; its output goes to ``<name>.log``."""
        with (self.directory / f"{name}.log").open("wb") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "bridge", *args],
                cwd=self.directory,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started.append((name, popen))

    def wait_ready(self, ready_dir: Path, workers: int) -> None:
        """Wait until ``workers`` workers are ready; stop if any process exits."""
        deadline = time.monotonic() + READY_TIMEOUT
        while len(list(ready_dir.iterdir())) < workers:
            for name, popen in self.started:
                if popen.poll() is not None:
                    log = (self.directory / f"{name}.log").read_text(errors="replace")
                    raise SystemExit(f"{name} exited:\n{log[-3000:]}")
            if time.monotonic() > deadline:
                raise SystemExit(f"the workers did not start within {READY_TIMEOUT} s")
            time.sleep(0.1)

    def stop(self) -> None:
        """Warm shutdown (Celery then removes its own broker bindings), SIGKILL if slow."""
        for _name, popen in self.started:
            popen.send_signal(signal.SIGTERM)
        for _name, popen in self.started:
            with suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=15)
            with suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()


def count(engine: sa.Engine, table, *where) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(table).where(*where)).scalar()


def server_commits(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SHOW GLOBAL STATUS WHERE Variable_name IN ('Com_commit', 'Handler_commit')"
        ).all()
    return {name: int(value) for name, value in rows}


def client_commits(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir())


def run(args: argparse.Namespace, stack: ExitStack) -> dict[str, float]:
    work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bridge-bench-")))
    commits_dir, ready_dir = work / "commits", work / "ready"
    commits_dir.mkdir()
    ready_dir.mkdir()
    (work / "sitecustomize.py").write_text(PROCESS_HOOKS)
    database_url = stack.enter_context(throwaway_database(args.database))
    suffix = secrets.token_hex(4)
    task_queue, control_queue = f"bench-{suffix}", f"bench-control-{suffix}"
    stack.callback(delete_queues, args.broker, [task_queue, control_queue], suffix)

    env = {k: v for k, v in os.environ.items() if not k.startswith("BRIDGE_")}
    env.update(
        BRIDGE_DATABASE_URL=database_url,
        BRIDGE_BROKER_URL=args.broker,
        BRIDGE_DEFAULT_QUEUE=task_queue,
        BRIDGE_CONTROL_QUEUE=control_queue,
        BRIDGE_POLL_INTERVAL=args.poll_interval,
        BRIDGE_MAX_INFLIGHT=args.max_inflight,
        BRIDGE_TASK_EVENTS=str(args.task_events).lower(),
        PHORGE_BRIDGE_BENCH_DIR=str(work),
        PYTHONPATH=os.pathsep.join(filter(None, [str(work), env.get("PYTHONPATH")])),
    )
    processes = Processes(work, env)
    stack.callback(processes.stop)
    options = ["-l", "WARNING", "--without-mingle", "--without-gossip"]
    if args.prefetch_multiplier:
        options += ["--prefetch-multiplier", str(args.prefetch_multiplier)]
    for n in range(1, args.workers + 1):
        processes.start(
            f"worker-{n}", "worker", "-n", f"bench-{n}-{suffix}@%h", "-Q", task_queue,
            "-c", str(args.concurrency), *options,
        )  # fmt: skip
    processes.start(
        "poller", "worker", "-n", f"poller-{suffix}@%h", "-Q", control_queue, "-c", "1",
        *options,
    )  # fmt: skip
    processes.start("beat", "beat", "-l", "WARNING", "-s", str(work / "beat-schedule"))
    processes.wait_ready(ready_dir, args.workers + 1)

    queue = PhorgeQueue(make_engine(database_url))
    stack.callback(queue.engine.dispose)
    server_before = server_commits(queue.engine)
    client_before = client_commits(commits_dir)
    started = time.perf_counter()
    # One transaction: every task becomes due at the same moment.
    queue.enqueue_many([NewTask(TASK_CLASS, {})] * args.tasks)
    while count(queue.engine, archive) < args.tasks:
        time.sleep(0.02)
    elapsed = time.perf_counter() - started
    client = client_commits(commits_dir) - client_before
    server_after = server_commits(queue.engine)

    left, failed = count(queue.engine, active), count(queue.engine, archive, archive.c.result != 0)
    if left or failed:
        raise SystemExit(f"{left} task(s) still active, {failed} archived as failed")
    # Minus the enqueue: one commit of this process, not of the bridge.
    server = {name: server_after[name] - server_before[name] - 1 for name in server_after}
    return {
        "seconds": elapsed,
        "tasks/s": args.tasks / elapsed,
        "commits/task": client / args.tasks,
        "Com_commit/task": server["Com_commit"] / args.tasks,
        "Handler_commit/task": server["Handler_commit"] / args.tasks,
    }


def main() -> None:
    args = parse_args()
    with ExitStack() as stack:
        figures = run(args, stack)
    print(
        f"{args.tasks} tasks, {args.workers} worker(s) x {args.concurrency} processes, "
        f"{args.broker.split('://')[0]}, poll {args.poll_interval} s, "
        f"max in flight {args.max_inflight}, events {'on' if args.task_events else 'off'}: "
        f"{figures['seconds']:.2f} s, "
        f"{figures['tasks/s']:.0f} tasks/s, {figures['commits/task']:.3f} commits/task "
        f"(server-wide: Com_commit {figures['Com_commit/task']:.3f}, "
        f"Handler_commit {figures['Handler_commit/task']:.3f} per task)"
    )


if __name__ == "__main__":
    main()

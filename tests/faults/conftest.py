"""The fault suite's harness: private servers to break, a bridge to break them under, checks.

The shared MariaDB, RabbitMQ and Redis serve every test run on the machine, CI included:
nothing here may restart, stop, freeze or kill them. Every scenario runs on servers of
its own (MariaDB on 3317, Redis on 6389, RabbitMQ on 5682, or the next free ports when
another fault run holds those), bound to 127.0.0.1 with their state in a temporary
directory, started once per session and stopped at its end.

A scenario queues ``FaultTask`` rows (``fault_handlers.py``, which records every run with
the lease it ran under), breaks something once a quarter is archived, and ends with
:meth:`FaultRun.check`: every task archived exactly once with the right result, nothing
left leased, no lease run twice, the workers still serving; it prints how long the queue
stalled and how soon it moved again after the fault ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import bridge_harness as harness
import pytest
import sqlalchemy as sa
from local_ports import claim_port
from mariadb_launcher import MariaDB
from private_brokers import PrivateBroker, PrivateRabbitMQ, PrivateRedis, _gone, _poll

from bridge.queue.model import RESULT_SUCCESS
from bridge.queue.schema import metadata
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive

HERE = Path(__file__).parent
# First choices; a concurrent fault run (another checkout) holding one moves us up: each
# port is claimed for the session (local_ports.claim_port), so two runs never pick one.
MARIADB_PORT, REDIS_PORT, RABBITMQ_PORT = 3317, 6389, 5682
# Settings of every fault bridge: a lost message comes back within a short dispatch
# lease, and a native retry waits 1 s.
SETTINGS = {
    "DISPATCH_LEASE": "10",
    "RETRY_BASE": "1",
    "RETRY_MAX": "1",
    "RETRY_JITTER": "0",
    "MAX_INFLIGHT": "20",
}
FINISH_TIMEOUT = 180.0  # generous: a loaded 2-core machine, a RabbitMQ restart on the way


# -- private servers -------------------------------------------------------------------------


class PrivateMariaDB:
    """A ``mariadbd`` of the suite's own; it may be restarted, killed and frozen.

    Started by the project's one launcher (``scripts/mariadb_launcher.py``), with the
    test servers' settings: fast commits, user bridge/bridge (who may create accounts).
    """

    def __init__(self, directory: Path, port: int) -> None:
        self.server = MariaDB(directory, port, grant_option=True)
        self.port, self.url = port, self.server.url
        self.popen: subprocess.Popen | None = None
        self.server.install()

    def start(self) -> None:
        self.popen = self.server.start()

    def _end(self, sig: int) -> None:
        if self.popen is None:
            return
        self.popen.send_signal(sig)
        self.popen.wait(timeout=60)
        self.popen = None

    def stop(self) -> None:
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        self._end(signal.SIGKILL)

    def signal(self, sig: int) -> None:
        assert self.popen is not None
        self.popen.send_signal(sig)


class FaultRedis(PrivateRedis):
    def kill(self) -> None:
        pid = int(self.pidfile.read_text())
        os.kill(pid, signal.SIGKILL)
        _poll(lambda: _gone(pid), 60, "private Redis to die")
        self.pidfile.unlink(missing_ok=True)


class FaultRabbitMQ(PrivateRabbitMQ):
    def kill(self) -> None:
        pid = int(Path(self.env["RABBITMQ_PID_FILE"]).read_text())
        os.kill(pid, signal.SIGKILL)
        _poll(lambda: _gone(pid), 60, "private RabbitMQ to die")


@pytest.fixture(scope="session")
def fault_mariadb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateMariaDB]:
    server = PrivateMariaDB(tmp_path_factory.mktemp("fault-mariadb"), claim_port(MARIADB_PORT))
    server.start()
    try:
        yield server
    finally:
        with_suppressed(server.signal, signal.SIGCONT)  # a failed stall test left it frozen
        server.stop()


def with_suppressed(action: Callable[..., Any], *args: Any) -> None:
    try:
        action(*args)
    except Exception as exc:  # teardown goes on
        print(f"teardown: {action.__name__}: {exc}")


@pytest.fixture(scope="session")
def fault_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultRedis]:
    server = FaultRedis(tmp_path_factory.mktemp("fault-redis"), port=claim_port(REDIS_PORT))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def fault_rabbitmq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultRabbitMQ]:
    port = claim_port(RABBITMQ_PORT, offsets=(0, 20000))  # and its distribution port
    server = FaultRabbitMQ(tmp_path_factory.mktemp("fault-rabbitmq"), port=port)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["rabbitmq", "redis"])
def fault_broker(request: pytest.FixtureRequest) -> PrivateBroker:
    """Each private broker in turn."""
    return request.getfixturevalue(f"fault_{request.param}")


@contextmanager
def _database(server_url: str) -> Iterator[str]:
    """A fresh database with Phorge's tables on the private MariaDB, as a URL."""
    name = f"faults_{os.urandom(4).hex()}"
    server = sa.create_engine(server_url, pool_pre_ping=True)
    with server.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE `{name}`")
    engine = sa.create_engine(f"{server_url}/{name}")
    metadata.create_all(engine)
    engine.dispose()
    try:
        yield f"{server_url}/{name}"
    finally:
        with server.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
        server.dispose()


@pytest.fixture
def fault_database(fault_mariadb: PrivateMariaDB) -> Iterator[str]:
    with _database(fault_mariadb.url) as url:
        yield url


@pytest.fixture(scope="module")
def module_fault_database(fault_mariadb: PrivateMariaDB) -> Iterator[str]:
    with _database(fault_mariadb.url) as url:
        yield url


# -- the bridge under test -------------------------------------------------------------------


class FaultBridge(harness.Bridge):
    """The acceptance ``Bridge`` with ``FaultTask`` and per-process wall-clock offsets."""

    def __init__(self, directory: Path, database_url: str, broker_url: str, **settings: str):
        super().__init__(directory, database_url, broker_url, **{**SETTINGS, **settings})
        self.fault_plugin = harness.write_plugin(
            directory / "faultplugin",
            HERE / "fault_handlers.py",
            "FaultTask = fault_handlers:FaultTask",
            extra=(HERE / "sitecustomize.py",),  # the wall-clock shim
        )
        self.clock_offsets: dict[str, float] = {}

    def environ(self, worker_name: str) -> dict[str, str]:
        env = super().environ(worker_name)
        env["PYTHONPATH"] = os.pathsep.join([str(self.fault_plugin), env["PYTHONPATH"]])
        if worker_name in self.clock_offsets:
            env["PHORGE_BRIDGE_FAKE_CLOCK_OFFSET"] = str(self.clock_offsets[worker_name])
        return env

    def serve(self, concurrency: int = 2) -> list[harness.CeleryProcess]:
        """One worker on both queues and beat, ready."""
        worker = self.worker(
            "worker", [self.default_queue, self.control_queue], concurrency=concurrency
        )
        self.beat()
        self.wait_ready(worker)
        return [worker]

    def fault_runs(self) -> list[dict[str, Any]]:
        """Every recorded ``FaultTask`` run (with the lease it ran under)."""
        return [r for r in self.runs() if "owner" in r]


@pytest.fixture
def make_fault_bridge(tmp_path: Path) -> Iterator[Callable[..., FaultBridge]]:
    """A factory of :class:`FaultBridge` deployments, all stopped at teardown."""
    with harness.deployments(tmp_path, FaultBridge) as make:
        yield make


@pytest.fixture(scope="module")
def make_module_fault_bridge(tmp_path_factory) -> Iterator[Callable[..., FaultBridge]]:
    """``make_fault_bridge`` for a deployment serving every test of a module."""
    with harness.deployments(tmp_path_factory.mktemp("faults"), FaultBridge) as make:
        yield make


# -- a run under a fault, and its checks ----------------------------------------------------


class Sampler:
    """Counts the run's archived tasks every 0.1 s (monotonic time), to measure stalls."""

    def __init__(self, engine: sa.Engine, ids: list[int]) -> None:
        self.query = sa.select(sa.func.count()).select_from(archive).where(archive.c.id.in_(ids))
        self.engine = engine
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                with self.engine.connect() as conn:
                    count = conn.execute(self.query).scalar_one()
            except sa.exc.DBAPIError:
                continue  # the database is the fault: no sample
            self.samples.append((time.monotonic(), count))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def longest_stall(self) -> float:
        """The longest time the count did not move, between the first and the last archive."""
        moves = [t for (_, a), (t, b) in pairwise(self.samples) if b > a]
        return max((b - a for a, b in pairwise(moves)), default=0.0)

    def moved_after(self, since: float) -> float | None:
        """Seconds from ``since`` (monotonic) until the count grew, or None if it never did."""
        before = max((n for t, n in self.samples if t <= since), default=0)
        return next((t - since for t, n in self.samples if t > since and n > before), None)


@dataclass
class FaultRun:
    """A batch of ``FaultTask`` rows under one fault; ``check`` ends every scenario."""

    bridge: FaultBridge
    name: str
    ids: list[int] = field(default_factory=list)
    expected: dict[int, int] = field(default_factory=dict)  # id -> archive result
    sampler: Sampler | None = None
    fault_over: float | None = None  # monotonic time the fault ended

    def queue(
        self,
        count: int,
        *,
        duration: float = 0.2,
        fail_times: int = 0,
        result: int = RESULT_SUCCESS,
    ) -> list[int]:
        ids = self.bridge.enqueue(
            "FaultTask", {"duration": duration, "failTimes": fail_times}, count=count
        )
        self.add(ids, result)
        return ids

    def add(self, ids: list[int], result: int) -> None:
        self.ids += ids
        self.expected.update(dict.fromkeys(ids, result))

    def start(self) -> None:
        self.sampler = Sampler(self.bridge.engine, self.ids)

    def wait_fraction(self, fraction: float) -> None:
        """Wait until that fraction of the run is archived: the moment to break something."""
        goal = int(len(self.ids) * fraction)
        self.bridge.wait_until(
            lambda: self.bridge.count(archive, archive.c.id.in_(self.ids)) >= goal,
            FINISH_TIMEOUT,
            f"{goal} of {len(self.ids)} tasks archived",
        )

    def over(self) -> None:
        """The fault has ended (the service is back)."""
        self.fault_over = time.monotonic()

    def check(self, *, recover_within: float | None = None) -> None:
        """Every task archived once with its result, nothing leased, no lease run twice,
        the workers still serving; prints the stall and the recovery."""
        bridge = self.bridge
        rows = bridge.wait_archived(self.ids, timeout=FINISH_TIMEOUT)
        assert self.sampler is not None
        self.sampler.stop()
        wrong = {i: r.result for i, r in rows.items() if r.result != self.expected[i]}
        assert not wrong, f"wrong results {wrong}"
        assert bridge.active_rows(self.ids) == {}, "archived but still active"
        with bridge.engine.connect() as conn:
            now = conn.execute(sa.select(sa.func.unix_timestamp())).scalar_one()
            leased = conn.execute(
                sa.select(sa.func.count()).select_from(active)
                .where(active.c.leaseOwner.is_not(None), active.c.leaseExpires > now)
            ).scalar_one()  # fmt: skip
        assert leased == 0, "a lease was left behind"
        runs = Counter((r["id"], r["owner"], r["failureCount"]) for r in bridge.fault_runs())
        twice = {lease: n for lease, n in runs.items() if n > 1}
        assert not twice, f"run twice under one lease: {twice}"
        recovery = self.sampler.moved_after(self.fault_over) if self.fault_over else None
        print(
            f"\n[fault] {self.name}: {len(self.ids)} tasks, longest stall "
            f"{self.sampler.longest_stall():.1f} s, queue moving again "
            + (f"{recovery:.1f} s after the fault ended" if recovery is not None else "(n/a)")
        )
        if recover_within is not None:
            assert recovery is not None and recovery <= recover_within, recovery
        self.still_serving()

    def still_serving(self) -> None:
        # A process the scenario SIGKILLed was the fault itself; any other exit fails.
        dead = [
            p.name
            for p in self.bridge.processes
            if not p.running() and p.popen.returncode != -signal.SIGKILL
        ]
        assert not dead, f"{dead} exited:\n{self.bridge.diagnose()}"
        fresh = self.bridge.enqueue("FaultTask", {}, count=3)
        self.bridge.wait_archived(fresh, timeout=60)


@pytest.fixture
def fault_run(request: pytest.FixtureRequest) -> Callable[[FaultBridge], FaultRun]:
    return lambda bridge: FaultRun(bridge, request.node.name)

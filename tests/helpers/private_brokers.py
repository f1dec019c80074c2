"""Private Redis and RabbitMQ servers that a test may restart.

The shared brokers of ``scripts/services.sh`` serve every test run on the machine and
must never be restarted; a fault test that restarts its broker starts one of these on
ports of its own, with all state in a temporary directory, bound to 127.0.0.1.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

START_TIMEOUT = 60.0  # RabbitMQ alone takes about 6 s on an idle machine


def _poll(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:.0f}s")
        time.sleep(0.05)


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _gone(pid: int) -> bool:
    """The process has exited (a zombie counts: PID 1 here reaps orphans late)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


class PrivateBroker:
    """A broker server of the test's own; ``restart(down)`` stops it for ``down`` seconds."""

    url: str

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def restart(self, down: float) -> float:
        """Stop, stay down ``down`` seconds, start; returns when it accepts clients again."""
        self.stop()
        try:
            time.sleep(down)  # the outage itself, not a synchronisation
        finally:
            # Also when a timeout interrupts the outage: the next test needs the broker.
            self.start()
        return time.monotonic()


class PrivateRedis(PrivateBroker):
    """``redis-server`` with an append-only file, so a restart keeps queues and unacked."""

    def __init__(self, directory: Path, port: int = 6399) -> None:
        self.directory, self.port = directory, port
        self.url = f"redis://127.0.0.1:{port}"
        directory.mkdir(parents=True, exist_ok=True)
        if _port_open(port):
            raise RuntimeError(f"port {port} is taken: is another fault run going on?")

    @property
    def pidfile(self) -> Path:
        return self.directory / "redis.pid"

    def start(self) -> None:
        """Start it, and again while it does not answer: a server killed a moment ago can
        still hold the port, and the new one then exits at once ("Address already in
        use"); a second start while the first one loads its file exits as harmlessly."""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            subprocess.run(
                ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--daemonize",
                 "yes", "--save", "", "--appendonly", "yes", "--dir", str(self.directory),
                 "--pidfile", str(self.pidfile), "--logfile", str(self.directory / "redis.log")],
                check=True,
            )  # fmt: skip
            try:
                _poll(lambda: self._ping(), 5, "private Redis to answer")
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"private Redis to answer within {START_TIMEOUT:.0f}s"
                    ) from None

    def _ping(self) -> bool:
        result = subprocess.run(
            ["redis-cli", "-h", "127.0.0.1", "-p", str(self.port), "ping"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        return result.stdout.strip() == "PONG"

    def stop(self) -> None:
        if not self.pidfile.exists():
            return
        pid = int(self.pidfile.read_text())
        if not _gone(pid):
            os.kill(pid, signal.SIGTERM)
            _poll(lambda: _gone(pid), START_TIMEOUT, "private Redis to exit")
        self.pidfile.unlink(missing_ok=True)


class PrivateRabbitMQ(PrivateBroker):
    """A RabbitMQ node ``restarts@localhost`` on 5692, its state kept across restarts."""

    def __init__(self, directory: Path, port: int = 5692) -> None:
        self.port = port
        self.url = f"amqp://guest:guest@127.0.0.1:{port}//"
        if _port_open(port):
            raise RuntimeError(f"port {port} is taken: is another fault run going on?")
        # Debian's wrapper runs the node as user rabbitmq, which cannot enter pytest's
        # private (0700) temporary tree: the state lives in /tmp, linked from there.
        state = Path(tempfile.mkdtemp(prefix=f"phorge-bridge-rabbitmq-{port}-"))
        atexit.register(shutil.rmtree, state, ignore_errors=True)
        shutil.chown(state, "rabbitmq", "rabbitmq")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "rabbitmq").symlink_to(state)
        self.env = {
            **os.environ,
            "RABBITMQ_NODENAME": f"restarts{port}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(port),
            "RABBITMQ_DIST_PORT": str(port + 20000),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "RABBITMQ_MNESIA_BASE": str(state / "mnesia"),
            "RABBITMQ_LOG_BASE": str(state / "log"),
            "RABBITMQ_PID_FILE": str(state / "rabbitmq.pid"),
        }

    def start(self) -> None:
        subprocess.run(
            ["rabbitmq-server", "-detached"],
            env=self.env,
            check=True,
            timeout=START_TIMEOUT,
            capture_output=True,
        )
        # `rabbitmqctl await_startup` fails right after -detached: try real logins.
        _poll(self._login, START_TIMEOUT, "private RabbitMQ to accept logins")

    def _login(self) -> bool:
        import amqp

        try:
            with amqp.Connection(f"127.0.0.1:{self.port}", connect_timeout=2):
                return True
        except Exception:
            return False

    def stop(self) -> None:
        pidfile = Path(self.env["RABBITMQ_PID_FILE"])
        if not pidfile.exists():
            return
        # Given the pid file, rabbitmqctl stop returns once the node has exited.
        subprocess.run(
            ["rabbitmqctl", "stop", str(pidfile)],
            env=self.env,
            timeout=START_TIMEOUT,
            capture_output=True,
            check=False,
        )
        _poll(lambda: not _port_open(self.port), START_TIMEOUT, "private RabbitMQ to exit")

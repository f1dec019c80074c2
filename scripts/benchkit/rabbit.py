"""The broker: the RabbitMQ on 127.0.0.1:5672, reused, or started (and later stopped) here.

Each bench run gets a virtual host of its own, deleted at the end: the bridge keeps its
default queue names (``phorge``, ``bridge.control``) yet cannot meet another user's
workers or messages on a shared server. If ``rabbitmqctl`` cannot reach the node (a
RabbitMQ not started by ``scripts/services.sh``), the bench falls back to the default
virtual host and queue names of its own, and says so in the report.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchkit.procs import BenchError

HOST, PORT = "127.0.0.1", 5672
SERVICES_DIR = Path(os.environ.get("PHORGE_BRIDGE_SERVICES_DIR", "/tmp/phorge-bridge-services"))


@dataclass(frozen=True)
class Broker:
    url: str
    vhost: str | None  # None: the default vhost, shared with others


def rabbitmq_env() -> dict[str, str]:
    """What ``scripts/services.sh`` exports for every rabbitmqctl call (see that script)."""
    env = dict(os.environ)
    env.update(
        RABBITMQ_NODENAME="rabbit@localhost",
        RABBITMQ_NODE_IP_ADDRESS=HOST,
        RABBITMQ_NODE_PORT=str(PORT),
        ERL_EPMD_ADDRESS=HOST,
        RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
        RABBITMQ_MNESIA_BASE=str(SERVICES_DIR / "rabbitmq" / "mnesia"),
        RABBITMQ_LOG_BASE=str(SERVICES_DIR / "rabbitmq" / "log"),
        RABBITMQ_PID_FILE=str(SERVICES_DIR / "rabbitmq" / "rabbitmq.pid"),
    )
    return env


def answers() -> bool:
    """A real AMQP login works (the port opens seconds before logins do)."""
    try:
        import amqp

        with amqp.Connection(f"{HOST}:{PORT}", connect_timeout=3):
            return True
    except Exception:
        return False


def _services(repo: Path, action: str) -> None:
    done = subprocess.run(
        ["bash", str(repo / "scripts" / "services.sh"), action],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode:
        raise BenchError(f"scripts/services.sh {action} failed:\n{done.stderr[-2000:]}")


def _ctl(*args: str) -> bool:
    try:
        done = subprocess.run(
            ["rabbitmqctl", *args], env=rabbitmq_env(), capture_output=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@contextmanager
def broker(repo: Path, log: Callable[[str], None]) -> Iterator[Broker]:
    """Reuse or start RabbitMQ, make a private vhost; undo both afterwards."""
    started = False
    if not answers():
        log("RabbitMQ does not answer on 127.0.0.1:5672: bash scripts/services.sh start")
        _services(repo, "start")
        started = True
    vhost = f"bridge-bench-{secrets.token_hex(4)}"
    if not (
        _ctl("add_vhost", vhost) and _ctl("set_permissions", "-p", vhost, "guest", *[".*"] * 3)
    ):
        log("rabbitmqctl cannot reach the node: using the default vhost, queues of our own")
        vhost = None
    try:
        yield Broker(f"amqp://guest:guest@{HOST}:{PORT}/{vhost or '/'}", vhost)
    finally:
        if vhost:
            _ctl("delete_vhost", vhost)
        if started:
            log("stopping the services the bench started (bash scripts/services.sh stop)")
            _services(repo, "stop")


def queue_depths(vhost: str) -> str:
    """``rabbitmqctl list_queues`` of the bench's vhost: where messages wait (diagnostics)."""
    columns = ["name", "messages_ready", "messages_unacknowledged", "consumers"]
    try:
        done = subprocess.run(
            ["rabbitmqctl", "list_queues", "-q", "-p", vhost, *columns],
            env=rabbitmq_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(rabbitmqctl list_queues failed: {exc})"
    return done.stdout.strip()


def rabbitmq_pid() -> int | None:
    """The broker's process, if services.sh started it (for its CPU time)."""
    try:
        return int((SERVICES_DIR / "rabbitmq" / "rabbitmq.pid").read_text().strip())
    except (OSError, ValueError):
        return None

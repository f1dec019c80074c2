"""The RabbitMQ of ``scripts/services.sh`` (started if it does not answer), with a vhost of
its own per run, so the bridge keeps its queue names yet meets no other user's workers;
if ``rabbitmqctl`` cannot reach the node, the default vhost and queue names of our own."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchkit import procs
from benchkit.procs import BenchError

SERVICES = (
    Path(os.environ.get("PHORGE_BRIDGE_SERVICES_DIR", "/tmp/phorge-bridge-services")) / "rabbitmq"
)


@dataclass(frozen=True)
class Broker:
    url: str
    shared: bool  # a vhost others use too: the bridge gets queue names of its own


def version() -> str | None:
    """The broker's version; None if it does not answer on 127.0.0.1:5672."""
    try:
        import amqp

        with amqp.Connection("127.0.0.1:5672", connect_timeout=3) as conn:
            return str(conn.server_properties.get("version"))
    except Exception:
        return None


def run(*command: str) -> bool:
    """Whether ``command`` (``rabbitmqctl`` or ``services.sh``) succeeded, with what
    ``scripts/services.sh`` exports for it."""
    env = dict(os.environ, RABBITMQ_NODENAME="rabbit@localhost", RABBITMQ_NODE_PORT="5672",
               RABBITMQ_NODE_IP_ADDRESS="127.0.0.1", ERL_EPMD_ADDRESS="127.0.0.1",
               RABBITMQ_MNESIA_BASE=str(SERVICES / "mnesia"),
               RABBITMQ_LOG_BASE=str(SERVICES / "log"),
               RABBITMQ_PID_FILE=str(SERVICES / "rabbitmq.pid"))  # fmt: skip
    env["RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"] = "-kernel inet_dist_use_interface {127,0,0,1}"
    try:
        return subprocess.run(command, env=env, capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@contextmanager
def broker(repo: Path, log: Callable[[str], None]) -> Iterator[Broker]:
    started = version() is None
    services = ("bash", str(repo / "scripts" / "services.sh"))
    if started:
        log("RabbitMQ does not answer on 127.0.0.1:5672: bash scripts/services.sh start")
        if not run(*services, "start"):
            raise BenchError("bash scripts/services.sh start failed")
    vhost: str | None = f"bridge-bench-{secrets.token_hex(4)}"
    permit = ("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    if not (run("rabbitmqctl", "add_vhost", vhost) and run("rabbitmqctl", *permit)):
        log("rabbitmqctl cannot reach the node: the default vhost, queues of our own")
        vhost = None
    try:
        yield Broker(f"amqp://guest:guest@127.0.0.1:5672/{vhost or '/'}", vhost is None)
    finally:
        if vhost:
            run("rabbitmqctl", "delete_vhost", vhost)
        if started:
            run(*services, "stop")


def cpu() -> float:
    """CPU seconds of the broker's process, if services.sh started it (else 0)."""
    try:
        stat = procs.scan().get(int((SERVICES / "rabbitmq.pid").read_text().strip()))
    except (OSError, ValueError):
        return 0.0
    return stat.cpu if stat else 0.0

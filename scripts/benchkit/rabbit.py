"""The broker: the RabbitMQ of ``scripts/services.sh`` on 127.0.0.1:5672 (started if it
does not answer, and then stopped), with a virtual host of its own per bench run, so the
bridge keeps its queue names yet meets no other user's workers. If ``rabbitmqctl``
cannot reach the node, the default vhost, and queue names of the bench's own."""

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


def answers() -> bool:
    try:
        import amqp

        with amqp.Connection("127.0.0.1:5672", connect_timeout=3):
            return True
    except Exception:
        return False


def run(*command: str) -> bool:
    """``rabbitmqctl`` with what ``scripts/services.sh`` exports for it, or ``bash
    scripts/services.sh``; whether it succeeded."""
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
    started = not answers()
    services = ("bash", str(repo / "scripts" / "services.sh"))
    if started:
        log("RabbitMQ does not answer on 127.0.0.1:5672: bash scripts/services.sh start")
        if not run(*services, "start"):
            raise BenchError("bash scripts/services.sh start failed")
    vhost: str | None = f"bridge-bench-{secrets.token_hex(4)}"
    ctl = ("rabbitmqctl",)
    if not (
        run(*ctl, "add_vhost", vhost)
        and run(*ctl, "set_permissions", "-p", vhost, "guest", *[".*"] * 3)
    ):
        log("rabbitmqctl cannot reach the node: the default vhost, queues of our own")
        vhost = None
    try:
        yield Broker(f"amqp://guest:guest@127.0.0.1:5672/{vhost or '/'}", vhost is None)
    finally:
        if vhost:
            run(*ctl, "delete_vhost", vhost)
        if started:
            run(*services, "stop")


def cpu() -> float:
    """CPU seconds of the broker's process, if services.sh started it (else 0)."""
    try:
        stat = procs.scan().get(int((SERVICES / "rabbitmq.pid").read_text().strip()))
    except (OSError, ValueError):
        return 0.0
    return stat.cpu if stat else 0.0

"""The RabbitMQ of ``scripts/services.sh`` (started if it does not answer), with a vhost of
its own per run: the bridge keeps its queue names, and its remote-control broadcasts meet
no other user's workers."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from benchkit import procs
from benchkit.procs import BenchError

SERVICES = (
    Path(os.environ.get("PHORGE_BRIDGE_SERVICES_DIR", "/tmp/phorge-bridge-services")) / "rabbitmq"
)
# What scripts/services.sh exports for rabbitmqctl to find its node.
CTL_ENV = {"RABBITMQ_NODENAME": "rabbit@localhost", "ERL_EPMD_ADDRESS": "127.0.0.1",
           "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1", "RABBITMQ_NODE_PORT": "5672",
           "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
           "RABBITMQ_MNESIA_BASE": str(SERVICES / "mnesia"),
           "RABBITMQ_LOG_BASE": str(SERVICES / "log"),
           "RABBITMQ_PID_FILE": str(SERVICES / "rabbitmq.pid")}  # fmt: skip


def version() -> str | None:
    """The broker's version; None if it does not answer on 127.0.0.1:5672."""
    try:
        import amqp

        with amqp.Connection("127.0.0.1:5672", connect_timeout=3) as conn:
            return str(conn.server_properties.get("version"))
    except Exception:
        return None


def run(*command: str) -> None:
    """``rabbitmqctl`` or ``services.sh``, with services.sh's environment; raises if it fails."""
    try:
        done = subprocess.run(
            command, env=os.environ | CTL_ENV, capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BenchError(f"{' '.join(command)}: {exc}") from None
    if done.returncode:
        raise BenchError(f"{' '.join(command)} failed:\n{(done.stdout + done.stderr)[-1000:]}")


@contextmanager
def broker(repo: Path, log: Callable[[str], None]) -> Iterator[str]:
    """The URL of a fresh vhost, deleted afterwards, with the broker if this started it."""
    services = ("bash", str(repo / "scripts" / "services.sh"))
    with ExitStack() as cleanup:
        if version() is None:
            log("RabbitMQ does not answer on 127.0.0.1:5672: bash scripts/services.sh start")
            run(*services, "start")
            cleanup.callback(run, *services, "stop")
        vhost = f"bridge-bench-{secrets.token_hex(4)}"
        run("rabbitmqctl", "add_vhost", vhost)
        cleanup.callback(run, "rabbitmqctl", "delete_vhost", vhost)
        run("rabbitmqctl", "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield f"amqp://guest:guest@127.0.0.1:5672/{vhost}"


def cpu() -> float:
    """CPU seconds of the broker's process, if services.sh started it (else 0)."""
    try:
        stat = procs.scan().get(int((SERVICES / "rabbitmq.pid").read_text().strip()))
    except (OSError, ValueError):
        return 0.0
    return stat.cpu if stat else 0.0

"""A bad setting stops ``celery -A bridge worker`` and ``celery -A bridge beat`` at start.

Each process must exit non-zero within seconds with one line on stderr naming the
setting, as ``phorge-bridge`` says it (``Error: configuration error: NAME: problem``),
not Celery's usage text and a traceback. The services in the URLs are never contacted:
the check comes before any connection.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

START_TIMEOUT = 60  # seconds; a process still running then was not refused (a loaded CI)
VALID = {
    "BRIDGE_DATABASE_URL": "mysql+mysqldb://bridge:bridge@127.0.0.1:3307/phorge_worker",
    "BRIDGE_BROKER_URL": "amqp://guest:guest@127.0.0.1:5672//",
}

# (bad settings, the setting the message must name, a word of what is accepted)
CASES = {
    "unknown-variable": ({"BRIDGE_POLL_INTERVALL": "1"}, "BRIDGE_POLL_INTERVALL", "unknown"),
    "database-scheme": (
        {"BRIDGE_DATABASE_URL": "postgresql://bridge@127.0.0.1/phorge"},
        "BRIDGE_DATABASE_URL",
        "mysql",
    ),
    "broker-scheme": (
        {"BRIDGE_BROKER_URL": "kafka://127.0.0.1:9092"},
        "BRIDGE_BROKER_URL",
        "amqp",
    ),
    "routes-rule": ({"BRIDGE_ROUTES": "PhabricatorSearchWorker"}, "BRIDGE_ROUTES", "glob=queue"),
    "routes-queue-name": ({"BRIDGE_ROUTES": "*Mail*=mail queue"}, "BRIDGE_ROUTES", "glob=queue"),
    "max-inflight-zero": ({"BRIDGE_MAX_INFLIGHT": "0"}, "BRIDGE_MAX_INFLIGHT", "positive"),
    "max-inflight-queue": (
        {"BRIDGE_MAX_INFLIGHT": "50,mail=-1"},
        "BRIDGE_MAX_INFLIGHT",
        "positive",
    ),
    "poll-interval-zero": ({"BRIDGE_POLL_INTERVAL": "0"}, "BRIDGE_POLL_INTERVAL", "positive"),
    "poll-interval-negative": (
        {"BRIDGE_POLL_INTERVAL": "-1"},
        "BRIDGE_POLL_INTERVAL",
        "positive",
    ),
    "dispatch-lease-zero": ({"BRIDGE_DISPATCH_LEASE": "0"}, "BRIDGE_DISPATCH_LEASE", "positive"),
    "conduit-without-token": (
        {"BRIDGE_CONDUIT_URL": "https://phorge.example.com"},
        "BRIDGE_CONDUIT_TOKEN",
        "token",
    ),
    "metrics-port-range": ({"BRIDGE_METRICS_PORT": "99999"}, "BRIDGE_METRICS_PORT", "65535"),
}
MAX_LINES = 2  # what an operator reads in a container's log before the restart


@pytest.mark.parametrize("command", ["worker", "beat"])
@pytest.mark.parametrize(("settings", "setting", "accepted"), CASES.values(), ids=CASES.keys())
def test_a_bad_setting_is_refused_at_start_with_its_name(
    bridge_environ, tmp_path, command, settings, setting, accepted
):
    env = {**bridge_environ, **VALID, **settings}
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "bridge", command],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
    )
    assert done.returncode == 1
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) <= MAX_LINES, done.stdout + done.stderr
    assert lines[0].startswith(f"Error: configuration error: {setting}: ")
    assert accepted in lines[0]
    assert list(tmp_path.iterdir()) == [], "the refused process left files behind"

"""compose/docker-compose.yml: every worker is restarted when it dies or stops consuming.

Docker cannot run on the test machines, so the file is checked as data: it parses, every
service restarts, and each ``celery worker`` refreshes a liveness file that its own
healthcheck reads with ``phorge-bridge health`` (and autoheal acts on).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

COMPOSE = Path(__file__).parents[2] / "compose" / "docker-compose.yml"


def test_every_worker_has_a_consumption_healthcheck_and_a_restart_policy():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    workers = {n: s for n, s in services.items() if " worker " in f" {s.get('command', '')} "}
    assert set(workers) == {"control", "search"}
    assert all(s["restart"] == "always" for s in services.values())
    for name, service in workers.items():
        words = shlex.split(service["command"].replace("'", " "))
        liveness = words[words.index("--liveness-file") + 1]
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "phorge-bridge", "health"], name
        assert test[test.index("--liveness-file") + 1] == liveness, name
        assert service["labels"]["autoheal"] == "true", name
    assert services["autoheal"]["environment"]["AUTOHEAL_CONTAINER_LABEL"] == "autoheal"

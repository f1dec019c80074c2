"""The shipped alert rules and dashboard, and Debian's ``prometheus`` package to check
them with (``promtool``, and the server itself, :class:`Prometheus`, for the acceptance
tests).

``scripts/services.sh install`` installs the package, so in CI (``CI=true``) a missing
binary fails the test: a skipped check proves nothing. Elsewhere it skips, naming the
package.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

COMPOSE = Path(__file__).parents[2] / "compose"
RULES = COMPOSE / "prometheus" / "rules.yml"
RULE_TESTS = COMPOSE / "prometheus" / "rules.test.yml"
DASHBOARD = COMPOSE / "grafana" / "dashboards" / "phorge-bridge.json"
SCRAPE_EVERY = "2s"  # the consumers gauge asks the workers, 1 s, once in 15 s


def prometheus_binary(name: str) -> str:
    """The path of ``name`` (``promtool``, ``prometheus``) from Debian's package."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: the rules are untested (scripts/services.sh install)")
    return path


def panel_queries() -> list[tuple[str, str]]:
    """Every query of the dashboard, with its panel's title."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", ())]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Prometheus:
    """A ``prometheus`` server of the test's own, on a free port, its data in tmp."""

    def __init__(self, directory: Path, targets: list[str]) -> None:
        config = {
            "global": {"scrape_interval": SCRAPE_EVERY, "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "phorge-bridge", "static_configs": [{"targets": targets}]}
            ],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = directory / "prometheus.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    prometheus_binary("prometheus"),
                    f"--config.file={directory / 'prometheus.yml'}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def api(self, path: str, **params: str) -> Any:
        reply = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=5).json()
        assert reply["status"] == "success", reply
        return reply["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` gives now, without its NaN elements."""
        result = self.api("query", query=expr)["result"]
        return [r for r in result if not math.isnan(float(r["value"][1]))]

    def ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except requests.ConnectionError:
            return False

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)

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
import re
import shutil
import subprocess
import time
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
LISTENING = re.compile(rb'msg="Listening on" address=(127\.0\.0\.1:\d+)')
START_TIMEOUT = 60.0


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


class Prometheus:
    """A ``prometheus`` server of the test's own, its data in tmp. It binds port 0 and
    :attr:`url` reads the port it got from its log (no port to pick, so no race)."""

    def __init__(self, directory: Path, targets: list[str]) -> None:
        config = {
            "global": {"scrape_interval": SCRAPE_EVERY, "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "phorge-bridge", "static_configs": [{"targets": targets}]}
            ],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._url: str | None = None
        self.log = directory / "prometheus.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    prometheus_binary("prometheus"),
                    f"--config.file={directory / 'prometheus.yml'}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    "--web.listen-address=127.0.0.1:0",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _listening(self) -> str | None:
        """``http://127.0.0.1:PORT`` once its log says where it listens, else None."""
        if self._url is None:
            found = LISTENING.search(self.log.read_bytes())
            if found is not None:
                self._url = f"http://{found[1].decode()}"
        return self._url

    @property
    def url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        while (url := self._listening()) is None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"Prometheus is not listening; its log ends:\n{tail}")
            time.sleep(0.1)
        return url

    def api(self, path: str, **params: str) -> Any:
        reply = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=5).json()
        assert reply["status"] == "success", reply
        return reply["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` gives now, without its NaN elements."""
        result = self.api("query", query=expr)["result"]
        return [r for r in result if not math.isnan(float(r["value"][1]))]

    def ready(self) -> bool:
        url = self._listening()
        if url is None:
            return False
        try:
            return requests.get(f"{url}/-/ready", timeout=1).status_code == 200
        except requests.ConnectionError:
            return False

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)

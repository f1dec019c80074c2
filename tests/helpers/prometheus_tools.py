"""The shipped alert rules and dashboard, and Debian's ``prometheus`` package to check
them with (``promtool``, and the server itself for the acceptance test).

``scripts/services.sh install`` installs the package, so in CI (``CI=true``) a missing
binary fails the test: a skipped check proves nothing. Elsewhere it skips, naming the
package.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

COMPOSE = Path(__file__).parents[2] / "compose"
RULES = COMPOSE / "prometheus" / "rules.yml"
RULE_TESTS = COMPOSE / "prometheus" / "rules.test.yml"
DASHBOARD = COMPOSE / "grafana" / "dashboards" / "phorge-bridge.json"


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

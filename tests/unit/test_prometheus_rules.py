"""The shipped alert rules pass ``promtool check rules``, and every alert has unit tests
in ``rules.test.yml`` (firing and not firing) that ``promtool test rules`` passes."""

from __future__ import annotations

import subprocess

import yaml
from prometheus_tools import RULE_TESTS, RULES, prometheus_binary


def promtool(*args: str) -> str:
    done = subprocess.run(
        [prometheus_binary("promtool"), *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_the_rules_are_valid():
    assert "SUCCESS: 9 rules found" in promtool("check", "rules", str(RULES))


def test_every_alert_fires_in_a_unit_test_and_stays_quiet_in_another():
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    checks = [
        c for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for c in t["alert_rule_test"]
    ]
    assert {c["alertname"] for c in checks if c["exp_alerts"]} == alerts
    assert {c["alertname"] for c in checks if not c["exp_alerts"]} == alerts
    assert "SUCCESS" in promtool("test", "rules", str(RULE_TESTS))

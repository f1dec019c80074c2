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
    assert "SUCCESS: 12 rules found" in promtool("check", "rules", str(RULES))


def test_every_alert_fires_in_a_unit_test_and_stays_quiet_in_another():
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    checks = [
        c for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for c in t["alert_rule_test"]
    ]
    assert {c["alertname"] for c in checks if c["exp_alerts"]} == alerts
    assert {c["alertname"] for c in checks if not c["exp_alerts"]} == alerts
    assert "SUCCESS" in promtool("test", "rules", str(RULE_TESTS))


def seconds(duration: str) -> int:
    """A promtool duration (``90s``, ``5m``, ``1h``) in seconds."""
    return int(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]


def alert_tests(alertname: str) -> list[dict]:
    """The unit tests of ``rules.test.yml`` that check ``alertname``, each with only
    those checks, in time order."""
    tests = []
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        checks = [c for c in test["alert_rule_test"] if c["alertname"] == alertname]
        checks.sort(key=lambda c: seconds(c["eval_time"]))
        if checks:
            tests.append({**test, "alert_rule_test": checks})
    return tests


def test_a_canary_rollback_fires_stays_quiet_at_partial_weights_and_resolves_after_promote():
    [rule] = [
        r
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for r in g["rules"]
        if r.get("alert") == "PhorgeBridgeCanaryRolledBack"
    ]
    summary, description = rule["annotations"]["summary"], rule["annotations"]["description"]
    assert "{{ $labels.task_class }}" in summary and "{{ $labels.level }}" in summary
    assert "phorge-bridge canary report {{ $labels.task_class }}" in description
    assert "phorge-bridge canary promote {{ $labels.task_class }}" in description
    tests = alert_tests("PhorgeBridgeCanaryRolledBack")

    def fired(check: dict) -> bool:
        return bool(check["exp_alerts"])

    # Fires, then is quiet again in the same test: resolved once the class is promoted.
    assert any(
        any(fired(c) for c in t["alert_rule_test"]) and not fired(t["alert_rule_test"][-1])
        for t in tests
    )
    # A test with shared classes (weights below 100) and no rollback never fires.
    assert any(
        any("phorge_bridge_canary_weight" in s["series"] for s in t["input_series"])
        and not any(fired(c) for c in t["alert_rule_test"])
        for t in tests
    )
    # promtool runs them: test_every_alert_fires_in_a_unit_test_and_stays_quiet_in_another

"""Where a PHP-only class runs: native handler first, then the PHP runner (when a Phorge
checkout is set and the class matches BRIDGE_RUNNER_CLASSES), then Conduit."""

from __future__ import annotations

from bridge.assembly import build_registry
from bridge.config import load_settings
from bridge.transports.php_runner.handler import PhpRunnerHandler

TOKEN = "api-" + "a" * 28
CONDUIT = {"BRIDGE_CONDUIT_URL": "https://phorge.example", "BRIDGE_CONDUIT_TOKEN": TOKEN}


def test_native_then_runner_then_conduit() -> None:
    registry = build_registry(
        load_settings(
            {**CONDUIT, "BRIDGE_PHORGE_ROOT": "/srv/phorge", "BRIDGE_RUNNER_CLASSES": "*Search*"}
        )
    )
    runner = registry.runner
    assert isinstance(runner, PhpRunnerHandler)
    assert registry.handler_for("PhabricatorTestWorker") is not runner  # native first
    assert registry.handler_for("PhabricatorSearchWorker") is runner
    assert registry.handler_for("PhabricatorMetaMTAWorker") is registry.fallback
    assert registry.handlers()[-2:] == [runner, registry.fallback]


def test_the_runner_alone_serves_every_php_class_by_default() -> None:
    registry = build_registry(load_settings({"BRIDGE_PHORGE_ROOT": "/srv/phorge"}))
    assert registry.fallback is None
    assert registry.handler_for("PhabricatorMetaMTAWorker") is registry.runner


def test_the_include_and_exclude_globs_narrow_the_runner_too() -> None:
    registry = build_registry(
        load_settings({"BRIDGE_PHORGE_ROOT": "/srv/phorge", "BRIDGE_HANDLERS_EXCLUDE": "*MetaMTA*"})
    )
    assert registry.handler_for("PhabricatorMetaMTAWorker") is None


def test_no_checkout_no_runner() -> None:
    registry = build_registry(load_settings(CONDUIT))
    assert registry.runner is None
    assert registry.handler_for("PhabricatorSearchWorker") is registry.fallback

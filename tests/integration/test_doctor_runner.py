"""doctor's PHP runner checks, on the stand-in Phorge: the binary, the boot, an answer,
and whether the checkout's copy of the shared task run is current."""

from __future__ import annotations

from pathlib import Path

import pytest
from php_standin import STANDIN_ROOT, php_binary

from bridge.cli.doctor import (
    Check,
    Doctor,
    check_php_extension_files,
    check_php_runner,
)
from bridge.config import load_settings
from bridge.phorge import extension as phorge_extension


def doctor_with(**env: str) -> Doctor:
    doctor = Doctor(settings=load_settings({f"BRIDGE_{k}": v for k, v in env.items()}))
    doctor.results["settings"] = Check("settings", "ok", "")
    return doctor


def test_a_runner_that_boots_and_answers_passes() -> None:
    doctor = doctor_with(PHORGE_ROOT=str(STANDIN_ROOT), RUNNER_PHP=php_binary())
    result = doctor.run(check_php_runner)
    assert result.status == "ok", result.detail
    assert result.detail.startswith("PHP 8.") and "answers" in result.detail


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"PHORGE_ROOT": "/nonexistent/phorge"}, "is not a Phorge checkout"),
        ({"PHORGE_ROOT": str(STANDIN_ROOT), "RUNNER_PHP": "/nonexistent/php"}, "not installed"),
    ],
    ids=["wrong-path", "php-missing"],
)
def test_a_runner_that_cannot_boot_fails_naming_the_settings(env: dict, reason: str) -> None:
    result = doctor_with(**env).run(check_php_runner)
    assert result.status == "fail"
    assert reason in result.detail and "BRIDGE_PHORGE_ROOT" in result.detail


def test_the_checks_do_not_apply_without_a_checkout() -> None:
    doctor = doctor_with()
    for check in (check_php_runner, check_php_extension_files):
        result = doctor.run(check)
        assert result.status == "ok" and "not applicable" in result.detail


def test_the_installed_task_run_must_be_current(tmp_path: Path) -> None:
    root = tmp_path / "phorge"
    workers = root / "src" / "infrastructure" / "daemon" / "workers"
    workers.mkdir(parents=True)
    (workers / "PhabricatorWorker.php").write_text("<?php\n")
    (root / "src" / "__phutil_library_map__.php").write_text("<?php\n")
    (root / "bin").mkdir()
    doctor = doctor_with(PHORGE_ROOT=str(root))
    missing = doctor.run(check_php_extension_files)
    assert missing.status == "warn" and "not installed" in missing.detail
    phorge_extension.install(root)
    assert doctor.run(check_php_extension_files).status == "ok"
    installed = root / "src" / "extensions" / phorge_extension.TASK_RUN_FILENAME
    installed.write_text(installed.read_text() + "\n// edited\n")
    outdated = doctor.run(check_php_extension_files)
    assert outdated.status == "warn" and "outdated" in outdated.detail

"""The shipped PHP extension: it parses (``php -l``), stays within Phorge's PHP 7.2, and
``install``/``check`` put it into a Phorge checkout and tell whether it is current.

php-cli is installed by the test script; when it is missing these tests fail, not skip.
Behaviour inside a real Phorge is covered by ``test_conduit_phorge.py`` (needs PHORGE_ROOT).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from importlib import resources
from importlib.metadata import version
from pathlib import Path

import pytest

from bridge.errors import PhorgeRootError
from bridge.phorge import extension as phorge_extension
from bridge.phorge.extension import (
    EXTENSION_FILENAME,
    EXTENSION_FILES,
    RUNNER_FILENAME,
    TASK_RUN_FILENAME,
    ExtensionState,
    check,
    install,
    shipped_file,
    shipped_source,
)


def php_binary() -> str:
    php = shutil.which("php")
    if php is None:
        pytest.fail("php is not installed (apt-get install -y php-cli): the extension is untested")
    return php


def shipped_php_files() -> list[Path]:
    package = Path(str(resources.files("bridge")))
    files = sorted(package.rglob("*.php"))
    assert files, "no PHP file shipped in bridge/"
    return files


def test_shipped_files_are_the_extension_and_the_runner() -> None:
    assert sorted(p.name for p in shipped_php_files()) == sorted(
        [*EXTENSION_FILES, RUNNER_FILENAME]
    )
    # Each where ``shipped_file`` looks for it: with the transport it serves.
    assert sorted(shipped_php_files()) == sorted(
        shipped_file(name) for name in [*EXTENSION_FILES, RUNNER_FILENAME]
    )


def test_the_methods_require_the_shared_task_run() -> None:
    """One implementation of a run: worker.execute calls it, the runner too (no copy)."""
    methods = shipped_source().decode()
    assert f"require_once dirname(__FILE__).'/{TASK_RUN_FILENAME}';" in methods
    assert "PhorgeBridgeTaskRun::run($task)" in methods
    assert "executeTask()" not in methods and "getQueuedTasks" not in methods
    runner = shipped_source(RUNNER_FILENAME).decode()
    assert "PhorgeBridgeTaskRun::run($task)" in runner and "executeTask()" not in runner
    assert "PhabricatorCaches::destroyRequestCache();" in shipped_source(TASK_RUN_FILENAME).decode()


@pytest.mark.parametrize("path", shipped_php_files(), ids=lambda p: p.name)
def test_php_lint(path: Path) -> None:
    completed = subprocess.run(
        [php_binary(), "-n", "-l", str(path)], capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "No syntax errors detected" in completed.stdout


# Syntax and functions newer than PHP 7.2.25, Phorge's minimum: Phorge includes extension
# files on every request, so one of these would take the whole install down.
TOO_NEW_TOKENS = [
    "T_FN",
    "T_COALESCE_EQUAL",
    "T_NULLSAFE_OBJECT_OPERATOR",
    "T_MATCH",
    "T_ATTRIBUTE",
    "T_ENUM",
    "T_READONLY",
    "T_NAME_QUALIFIED",
]
TOO_NEW_FUNCTIONS = [
    "str_contains",
    "str_starts_with",
    "str_ends_with",
    "array_key_first",
    "array_key_last",
    "is_countable",
    "get_debug_type",
    "array_is_list",
    "fdiv",
]
TOKEN_SCAN = r"""
$found = array();
$too_new = json_decode($argv[2], true);
$functions = array_flip(json_decode($argv[3], true));
foreach (token_get_all(file_get_contents($argv[1])) as $token) {
  if (!is_array($token)) { continue; }
  $name = token_name($token[0]);
  if (in_array($name, $too_new, true)) { $found[] = $name.' on line '.$token[2]; }
  if ($name === 'T_STRING' && isset($functions[strtolower($token[1])])) {
    $found[] = $token[1].'() on line '.$token[2];
  }
}
echo json_encode($found);
"""


@pytest.mark.parametrize("path", shipped_php_files(), ids=lambda p: p.name)
def test_php_72_compatible(path: Path) -> None:
    completed = subprocess.run(
        [
            php_binary(),
            "-r",
            TOKEN_SCAN,
            "--",
            str(path),
            json.dumps(TOO_NEW_TOKENS),
            json.dumps(TOO_NEW_FUNCTIONS),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(completed.stdout) == []
    source = path.read_text()
    # Typed properties (7.4) and union/mixed types (8.0) in declarations.
    assert " private ?" not in source and " protected ?" not in source
    assert "mixed $" not in source


def test_the_methods_are_admin_only_by_construction() -> None:
    """A cheap guard on the security-relevant declarations (real checks need Phorge)."""
    source = shipped_source().decode()
    for declaration in (
        "final public function shouldRequireAuthentication() {\n    return true;",
        "final public function shouldAllowPublic() {\n    return false;",
        "final public function getRequiredScope() {\n    return self::SCOPE_NEVER;",
        "final protected function execute(ConduitAPIRequest $request) {\n"
        "    $this->requireBridgeCaller($request);",
    ):
        assert declaration in source
    assert source.count("extends PhorgeBridgeConduitAPIMethod") == 3
    assert source.count("extends ConduitAPIMethod") == 1


# -- install / check ---------------------------------------------------------------------------


def fake_phorge(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    workers = root / "src" / "infrastructure" / "daemon" / "workers"
    workers.mkdir(parents=True)
    (workers / "PhabricatorWorker.php").write_text("<?php\n")
    (root / "src" / "__phutil_library_map__.php").write_text("<?php\n")
    return root


def test_install_then_check(tmp_path: Path) -> None:
    root = fake_phorge(tmp_path / "phorge")
    status = check(root)
    assert status.state is ExtensionState.MISSING and not status
    assert "not installed" in status.describe()

    installed = install(root)
    assert installed == root.resolve() / "src" / "extensions" / EXTENSION_FILENAME
    assert sorted(p.name for p in installed.parent.iterdir()) == sorted(EXTENSION_FILES)
    for name in EXTENSION_FILES:
        copy = installed.parent / name
        assert copy.read_bytes() == shipped_source(name)
        assert copy.stat().st_mode & 0o777 == 0o644
    status = check(root)
    assert status.state is ExtensionState.CURRENT and status
    assert status.installed_sha256 == status.shipped_sha256

    for name in EXTENSION_FILES:  # either file outdated makes the extension outdated
        copy = installed.parent / name
        copy.write_text(copy.read_text().replace("phorge-bridge", "phorge-bridge (old)"))
        status = check(root)
        assert status.state is ExtensionState.OUTDATED and not status
        assert "outdated" in status.describe()
        install(root)  # an upgrade overwrites
        assert check(root)

    (installed.parent / TASK_RUN_FILENAME).unlink()
    assert check(root).state is ExtensionState.MISSING


def test_install_keeps_phorges_readme(tmp_path: Path) -> None:
    root = fake_phorge(tmp_path / "phorge")
    extensions = root / "src" / "extensions"
    extensions.mkdir()
    (extensions / "README").write_text("Phorge's own file\n")
    install(root)
    assert sorted(p.name for p in extensions.iterdir()) == sorted(["README", *EXTENSION_FILES])


def test_root_must_look_like_phorge(tmp_path: Path) -> None:
    with pytest.raises(PhorgeRootError, match="not a directory"):
        install(tmp_path / "nothing")
    (tmp_path / "src").mkdir()
    with pytest.raises(PhorgeRootError, match="does not look like a Phorge checkout") as info:
        check(tmp_path)
    assert "bin" in str(info.value) and "__phutil_library_map__.php" in str(info.value)
    assert not (tmp_path / "src" / "extensions").exists()


def test_failed_install_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = fake_phorge(tmp_path / "phorge")

    def broken_replace(src: str, dst: Path) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(phorge_extension.os, "replace", broken_replace)
    with pytest.raises(OSError):
        install(root)
    assert list((root / "src" / "extensions").iterdir()) == []


def test_the_cli_installs_and_checks_the_extension(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from bridge.cli.main import main

    root = fake_phorge(tmp_path / "phorge")
    runner = CliRunner()
    command = ["phorge", "install-extension", "--phorge-root", str(root)]
    missing = runner.invoke(main, [*command, "--check"])
    assert (missing.exit_code, "not installed" in missing.output) == (1, True)
    installed = runner.invoke(main, command)
    assert installed.exit_code == 0 and EXTENSION_FILENAME in installed.output
    assert runner.invoke(main, [*command, "--check"]).exit_code == 0
    not_phorge = runner.invoke(
        main, ["phorge", "install-extension", "--phorge-root", str(tmp_path)]
    )
    assert not_phorge.exit_code == 1 and "does not look like a Phorge checkout" in not_phorge.output


def test_worker_version_reports_this_release_and_the_hash_doctor_compares(
    tmp_path: Path,
) -> None:
    """doctor compares worker.version's sha256 (PHP's digest of the installed files, as
    getExtensionHash() computes it) with the shipped bytes', and shows the release, the
    package's own."""
    source = shipped_source().decode()
    start = source.index("  private static function getExtensionHash() {")
    body = source[source.index("{", start) + 1 : source.index("\n  }\n", start)]
    # Installed, the extension's files lie side by side (shipped, each with its transport).
    for name in EXTENSION_FILES:
        shutil.copyfile(shipped_file(name), tmp_path / name)
    methods = tmp_path / EXTENSION_FILENAME
    code = f"function h() {{ {body.replace('__FILE__', json.dumps(str(methods)))} }} echo h();"
    php_hash = subprocess.run(
        [php_binary(), "-n", "-r", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert php_hash == phorge_extension.shipped_sha256()
    assert phorge_extension.shipped_version() == version("phorge-bridge")
    assert "return 'worker.version';" in shipped_source().decode()

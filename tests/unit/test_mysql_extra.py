"""The MySQL driver is the ``mysql`` extra: a plain install needs no compiler.

Without mysqlclient the whole package imports and runs on SQLite, and a MySQL URL stops
``phorge-bridge`` and ``celery -A bridge`` at start with one line naming the setting and
the extra. The driver is hidden by a ``MySQLdb`` module first on the path that fails as
an absent one does, so the processes a command starts lack it too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from bridge.config import ConfigError, load_settings

ROOT = Path(__file__).resolve().parents[2]
NOT_INSTALLED = "the MySQL driver is not installed: pip install 'phorge-bridge[mysql]'"
MYSQL_URL = "mysql+mysqldb://bridge:secret@127.0.0.1:3307/phorge_worker"


ABSENT = "ModuleNotFoundError(\"No module named 'MySQLdb'\", name='MySQLdb')"


def hide_driver(directory: Path, error: str = ABSENT) -> Path:
    """A directory whose ``MySQLdb`` raises ``error`` on import."""
    directory.mkdir()
    (directory / "MySQLdb.py").write_text(f"raise {error}\n")
    return directory


def without_driver(tmp_path: Path) -> dict[str, str]:
    """The environment of a process without the driver, and with no BRIDGE_* setting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BRIDGE_")}
    hidden = hide_driver(tmp_path / "no-mysqlclient")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hidden), env.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("scheme", ["mysql", "mysql+mysqldb", "mariadb", "mariadb+mysqldb"])
def test_a_mysql_url_without_the_driver_names_the_setting_and_the_extra(monkeypatch, scheme):
    monkeypatch.setitem(sys.modules, "MySQLdb", None)
    with pytest.raises(ConfigError) as refused:
        load_settings({"BRIDGE_DATABASE_URL": f"{scheme}://bridge:secret@db/phorge_worker"})
    assert refused.value.setting == "BRIDGE_DATABASE_URL"
    assert refused.value.problem == NOT_INSTALLED


def test_a_driver_that_does_not_load_says_why(monkeypatch, tmp_path):
    missing_library = "libmariadb.so.3: cannot open shared object file: No such file or directory"
    monkeypatch.delitem(sys.modules, "MySQLdb", raising=False)
    broken = hide_driver(tmp_path / "broken", f"ImportError({missing_library!r})")
    monkeypatch.syspath_prepend(broken)
    with pytest.raises(ConfigError) as refused:
        load_settings({"BRIDGE_DATABASE_URL": MYSQL_URL})
    assert str(refused.value) == (
        f"BRIDGE_DATABASE_URL: the MySQL driver (mysqlclient) does not load: {missing_library}"
    )


@pytest.mark.parametrize(
    "command",
    [["-m", "bridge.cli", "settings"], ["-m", "celery", "-A", "bridge", "worker"]],
    ids=["phorge-bridge", "celery"],
)
def test_a_mysql_url_without_the_driver_stops_the_process_in_one_line(tmp_path, command):
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    done = subprocess.run(
        [sys.executable, *command],
        env={**without_driver(tmp_path), "BRIDGE_DATABASE_URL": MYSQL_URL},
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    output = (done.stdout + done.stderr).strip().splitlines()
    assert output == [f"Error: configuration error: BRIDGE_DATABASE_URL: {NOT_INSTALLED}"]
    assert list(workdir.iterdir()) == []


def test_every_module_imports_and_a_task_runs_on_sqlite_without_the_driver(tmp_path):
    program = textwrap.dedent(
        f"""
        import importlib, pkgutil
        import bridge
        from bridge.config import load_settings
        from bridge.engine.batch import run_task
        from bridge.assembly import build_runtime

        for module in pkgutil.walk_packages(bridge.__path__, "bridge."):
            if not module.name.endswith("__main__"):
                importlib.import_module(module.name)
        settings = load_settings({{"BRIDGE_DATABASE_URL": "sqlite:///{tmp_path}/q.db"}})
        rt = build_runtime(settings)
        rt.queue.enqueue("PhabricatorTestWorker", {{}})
        [task] = rt.queue.lease(1, 60)
        print(run_task(rt, task.lease).outcome.value)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        env=without_driver(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "success"


def test_the_driver_is_the_mysql_extra_which_the_tests_and_the_image_install():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("mysqlclient")]
    extras = project["optional-dependencies"]
    assert extras["mysql"] == ["mysqlclient>=2.2"]
    assert "phorge-bridge[mysql]" in extras["test"]
    assert 'pip install --no-cache-dir ".[mysql]"' in (ROOT / "compose" / "Dockerfile").read_text()

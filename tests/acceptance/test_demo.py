"""The README's first command: the embedded run, end to end, with nothing set up, not
even the MySQL driver (the `mysql` extra): a ``MySQLdb`` first on the path fails as an
absent one does, in the demo and in the worker it starts."""

from __future__ import annotations

import os
import subprocess
import sys


def test_the_demo_runs_every_sample_to_its_outcome(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("BRIDGE_")}
    hidden = tmp_path / "no-mysqlclient"
    hidden.mkdir()
    (hidden / "MySQLdb.py").write_text("raise ModuleNotFoundError(name='MySQLdb')\n")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hidden), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "bridge.cli", "demo", "--dir", str(tmp_path), "--timeout", "90"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if "#" in line}
    expected = {
        "PhabricatorTestWorker#1": "archived: success after 0 failure(s)",
        "PhabricatorTestWorker#2": "archived: success after 0 failure(s), ran 1.",
        "PhabricatorTestWorker#3": "archived: success",
        "PhabricatorTestWorker#4": "archived: failure after 3 failure(s)",
        "PhabricatorTestWorker#5": "archived: success after 0 failure(s)",
        "PhabricatorTestWorker#6": "archived: failure after 0 failure(s)",
        "PhabricatorTestWorker#7": "archived: success",
    }
    assert sorted(lines) == sorted(expected), done.stdout
    for label, outcome in expected.items():
        assert outcome in lines[label], lines[label]
    assert (tmp_path / "phorge-worker.db").exists()

"""The shipped systemd unit of PhorgeBridgeQueueDaemon (``deploy/systemd/``) is one
systemd accepts as it is: ``systemd-analyze verify`` finds nothing to say of an
instance of it (an unknown key or a bad value is a warning systemd would ignore, and
the daemon would run without what it says). What it runs is tried on a real Phorge in
``tests/phorge/test_queue_daemon.py``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "systemd"


def test_systemd_verifies_an_instance_of_the_unit_without_a_word(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: scripts/services.sh install brings it"
    (unit,) = UNIT.glob("*@.service")
    shutil.copy(unit, tmp_path)
    instance = unit.name.replace("@.", "@1.")
    done = subprocess.run(
        [analyze, "verify", "--man=no", instance],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")

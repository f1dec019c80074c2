"""The deployed PHP code's stamp: what version of Phorge's PHP the runner runs.

A canary judges the new side afresh when what runs it changes (a deploy of new
Phorge code under the runner). The runner's processes are replaced once the reload stamp
(``BRIDGE_RUNNER_RELOAD_STAMP``, a file each deploy touches) is newer than they are, so
its time is the version in force; without one, the Phorge checkout's git commit, read
from its ``.git`` (no ``git`` binary needed) as a deploy by ``git pull`` leaves it.
"""

from __future__ import annotations

import os
from pathlib import Path

SHA_SHOWN = 12  # characters of a commit hash


def deploy_stamp(reload_stamp: Path | None, phorge_root: Path) -> str | None:
    """``deployed <unix time>`` of the reload stamp, else ``git <commit>`` of
    ``phorge_root``; None when neither can be read."""
    if reload_stamp is not None:
        try:
            return f"deployed {int(os.stat(reload_stamp).st_mtime)}"
        except OSError:
            pass
    commit = git_head(phorge_root / ".git")
    return None if commit is None else f"git {commit[:SHA_SHOWN]}"


def git_head(git_dir: Path) -> str | None:
    """The commit ``HEAD`` names in ``git_dir``: detached, a loose ref, or a packed one."""
    try:
        head = (git_dir / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head or None
        ref = head.removeprefix("ref: ")
        loose = git_dir / ref
        if loose.is_file():
            return loose.read_text().strip() or None
        for line in (git_dir / "packed-refs").read_text().splitlines():
            commit, _, name = line.partition(" ")
            if name == ref:
                return commit
    except OSError:
        return None
    return None

"""A worker's scratch directories (``bridge.scratch``): a killed worker's are removed by
the next worker that makes one of the same kind; a live worker's, its pool's included,
are kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.scratch import private_directory

PREFIX = "phorge-bridge-test-scratch-"

# A worker: makes its directory, forks a pool child when asked, says where, waits.
WORKER = f"""
import os, sys, time
from bridge.scratch import private_directory
directory = private_directory({PREFIX!r})
child = os.fork() if sys.argv[1] == "pool" else 0
if child == 0 and sys.argv[1] == "pool":
    time.sleep(600)
    os._exit(0)
print(directory, child, flush=True)
time.sleep(600)
"""


@pytest.fixture
def tmpdir_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """This process and the workers it starts make their directories in ``tmp_path``."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    yield {**os.environ, "TMPDIR": str(tmp_path)}


def start_worker(
    env: dict[str, str], pool: bool = False
) -> tuple[subprocess.Popen[str], Path, int]:
    """A worker; with ``pool``, one that forked a child (its pid, else 0)."""
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, "pool" if pool else "alone"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert worker.stdout is not None
    directory, child = worker.stdout.readline().split()
    return worker, Path(directory), int(child)


def kill_9(worker: subprocess.Popen[str]) -> None:
    """``kill -9``: its atexit never runs; once reaped, its files are closed."""
    worker.kill()
    worker.wait()


def test_a_killed_workers_directory_goes_with_the_next_one_made(tmpdir_env):
    killed, abandoned, _ = start_worker(tmpdir_env)
    live, kept, _ = start_worker(tmpdir_env)
    try:
        kill_9(killed)
        assert abandoned.is_dir()
        mine = private_directory(PREFIX)
        assert not abandoned.exists(), "a dead worker's directory is removed"
        assert kept.is_dir() and Path(mine).is_dir(), "a live one's is kept"
    finally:
        kill_9(live)


def test_a_killed_workers_directory_stays_while_its_pool_child_lives(tmpdir_env):
    """The child holds the lock it inherited: it still counts and writes there."""
    worker, directory, child = start_worker(tmpdir_env, pool=True)
    try:
        kill_9(worker)
        private_directory(PREFIX)
        assert directory.is_dir()
    finally:
        os.kill(child, signal.SIGKILL)

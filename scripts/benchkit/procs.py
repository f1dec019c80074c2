"""Processes the bench starts, and the CPU they and the machine use (from /proc).

Each starts a session of its own; as a descendant may leave it (phd calls ``posix_setsid``),
a *family* is the session plus every descendant by parent pid: CPU is summed over it, and
stopping kills the group, then the rest of the family.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TICKS = os.sysconf("SC_CLK_TCK")


class BenchError(Exception):
    """A scenario could not be measured; the message says why, for the report."""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def start(name: str, command: Sequence[str], *, log: Path, **kwargs: Any) -> Proc:
    """``command`` as the leader of a new session (``env``, ``cwd``, ``stdin``: Popen's),
    both output streams to ``log``."""
    kwargs.setdefault("stdin", subprocess.DEVNULL)
    with log.open("ab") as out:
        popen = subprocess.Popen(
            list(command), stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kwargs
        )
    return Proc(name, popen, log)


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    session: int
    name: str  # the command name: php, python3, mariadbd
    cpu: float  # CPU seconds, its own and those of the children it reaped
    zombie: bool


def scan() -> dict[int, ProcStat]:
    """Every process of the machine, zombies included (their CPU is not yet reaped)."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        close, pid = text.rindex(")"), int(entry)
        name, stat = text[text.index("(") + 1 : close], text[close + 2 :].split()
        cpu = sum(int(v) for v in stat[11:15]) / TICKS
        found[pid] = ProcStat(pid, int(stat[1]), int(stat[3]), name, cpu, stat[0] == "Z")
    return found


def family(table: dict[int, ProcStat], leader: int) -> list[ProcStat]:
    """``leader``'s session and every descendant by parent pid, each once."""
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    todo = [p.pid for p in table.values() if p.session == leader] + [leader]
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid not in seen and pid in table:
            seen.add(pid)
            todo.extend(children.get(pid, ()))
    return [table[pid] for pid in sorted(seen)]


def stop(proc: Proc, *, grace: float = 10.0, first_signal: int = signal.SIGTERM) -> None:
    """Ask, then SIGKILL the group and the family's strays (``SIGKILL`` first for Phorge's
    CLI, which ignores SIGTERM); waits until none is left."""
    strays = [p.pid for p in family(scan(), proc.pid) if p.session != proc.pid]
    if proc.alive() and first_signal != signal.SIGKILL:
        with suppress(ProcessLookupError):
            proc.popen.send_signal(first_signal)
        with suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=grace)
    for kill, target in [(os.killpg, proc.pid)] + [(os.kill, pid) for pid in strays]:
        with suppress(ProcessLookupError, PermissionError):
            kill(target, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        proc.popen.wait(timeout=10)

    def gone() -> bool:
        return all(p.zombie for p in scan().values() if p.session == proc.pid or p.pid in strays)

    wait_until(gone, timeout=10, what=f"{proc.name} to exit")


def wait_until(
    condition: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.05,
    check: Callable[[], None] | None = None,
) -> None:  # fmt: skip
    """Poll ``condition`` until true; ``check`` may raise early (a process died)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@dataclass(frozen=True)
class MachineCPU:
    """Jiffies of all CPUs together (the first line of /proc/stat)."""

    busy: int
    total: int

    @classmethod
    def sample(cls) -> MachineCPU:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        total = sum(values[:8])  # guest time is already in user
        return cls(total - values[3] - values[4], total)  # less idle and iowait

    def since(self, before: MachineCPU, known: float) -> tuple[float, float, float]:
        """CPU seconds the machine was busy since ``before``, the share of all cores that
        is, and of it the share that ``known`` CPU seconds (the measured processes') leave
        unexplained: a large one says the figures are disturbed."""
        busy, capacity = (self.busy - before.busy) / TICKS, (self.total - before.total) / TICKS
        share = busy / capacity if capacity else 0.0
        return busy, share, max(0.0, share - known / capacity) if capacity else 0.0

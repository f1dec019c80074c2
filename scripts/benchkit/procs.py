"""Processes the bench starts, and the CPU time they and the machine use (from /proc).

Every process is started in a session of its own (``start_new_session``), so it and its
descendants (prefork children, the PHP runner's processes) share one process group and
one session id. A descendant may leave the session: phd's daemon (``exec_daemon.php``)
calls ``posix_setsid()`` when its stdout is not a terminal. So a started process's
*family* is its session plus every descendant by parent pid (:func:`family`): CPU is
summed over the family, and stopping kills the group and then the rest of the family.
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

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class BenchError(Exception):
    """A scenario could not be measured; the message says why, for the report."""


@dataclass
class Proc:
    """A started process group and where its output goes."""

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


def start(
    name: str,
    command: Sequence[str],
    *,
    env: dict[str, str],
    cwd: Path,
    log: Path,
    stdin: int | None = subprocess.DEVNULL,
) -> Proc:
    """Start ``command`` as the leader of a new session; output (both streams) to ``log``."""
    with log.open("ab") as out:
        popen = subprocess.Popen(
            list(command),
            cwd=cwd,
            env=env,
            stdin=stdin,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Proc(name, popen, log)


def stop(proc: Proc, *, grace: float = 10.0, first_signal: int = signal.SIGTERM) -> None:
    """Ask the process to stop, then SIGKILL its whole group; always reaps the leader.

    ``first_signal=SIGKILL`` is for Phorge's CLI, which ignores SIGTERM.
    """
    # Descendants that left the session (phd's daemon) are found by parent pid, so they
    # are listed while the leader still lives; they are killed after it.
    strays = [p.pid for p in family(scan(), proc.pid) if p.session != proc.pid]
    if proc.alive() and first_signal != signal.SIGKILL:
        with suppress(ProcessLookupError):
            proc.popen.send_signal(first_signal)
        with suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=grace)
    # The group may outlive its leader (a prefork child, phd's daemon): kill it anyway.
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in strays:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        proc.popen.wait(timeout=10)
    wait_until(
        lambda: not session_pids(proc.pid) and not any(_alive(pid) for pid in strays),
        timeout=10,
        what=f"{proc.name} to exit",
    )


def wait_until(
    condition: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    interval: float = 0.05,
    check: Callable[[], None] | None = None,
) -> None:
    """Poll ``condition`` until true; ``check`` may raise early (a process died)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _stat_fields(pid: str) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (after the command name, which may hold spaces)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not: its parent reaps it)."""
    stat = _stat_fields(str(pid))
    return stat is not None and stat[0] != "Z"


@dataclass(frozen=True)
class ProcStat:
    """One process as /proc/<pid>/stat shows it."""

    pid: int
    ppid: int
    session: int
    name: str  # the command name (``comm``): ``php``, ``python3``, ``mariadbd``
    cpu: float  # CPU seconds of the process plus those of the children it has reaped


def scan() -> dict[int, ProcStat]:
    """Every process of the machine (zombies included: their CPU is not yet their
    parent's), in one pass over /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        stat = text[text.rindex(")") + 2 :].split()
        cpu = sum(int(v) for v in stat[11:15]) / CLOCK_TICKS
        found[int(entry)] = ProcStat(int(entry), int(stat[1]), int(stat[3]), name, cpu)
    return found


def family(table: dict[int, ProcStat], leader: int) -> list[ProcStat]:
    """The processes of ``leader``'s session and every descendant of them by parent pid
    (also those that started a session of their own), each once."""
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    todo = [p.pid for p in table.values() if p.session == leader]
    if leader in table and leader not in todo:
        todo.append(leader)
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, ()))
    return [table[pid] for pid in sorted(seen)]


def family_cpu(leader: int, table: dict[int, ProcStat] | None = None) -> float:
    """CPU seconds of :func:`family` (live processes, and what they reaped)."""
    return sum(p.cpu for p in family(scan() if table is None else table, leader))


def session_pids(session: int) -> list[int]:
    """Live (non-zombie) processes whose session id is ``session``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat_fields(entry)
            if stat and int(stat[3]) == session and stat[0] != "Z":
                pids.append(int(entry))
    return pids


def process_cpu(pid: int) -> float:
    """CPU seconds of one process, plus those of its children it has reaped."""
    stat = _stat_fields(str(pid))
    if stat is None:
        return 0.0
    # utime, stime, cutime, cstime are fields 14-17 (indexes 11-14 here).
    return sum(int(v) for v in stat[11:15]) / CLOCK_TICKS


def session_cpu(session: int) -> float:
    """CPU seconds of every live process of a session (and what they reaped)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat_fields(entry)
            if stat and int(stat[3]) == session:
                total += sum(int(v) for v in stat[11:15]) / CLOCK_TICKS
    return total


@dataclass(frozen=True)
class MachineCPU:
    """Jiffies of all CPUs together, from the first line of /proc/stat."""

    busy: int
    total: int

    def busy_seconds_since(self, before: MachineCPU) -> float:
        """CPU seconds the machine's cores were busy since ``before``, whoever used them."""
        return (self.busy - before.busy) / CLOCK_TICKS

    @classmethod
    def sample(cls) -> MachineCPU:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = values[3] + values[4]  # idle + iowait
        total = sum(values[:8])  # guest time is already counted in user
        return cls(total - idle, total)

    def busy_share_since(self, before: MachineCPU) -> float:
        """Share (0..1) of the machine's CPU capacity that was busy since ``before``."""
        total = self.total - before.total
        return (self.busy - before.busy) / total if total else 0.0

    def capacity_since(self, before: MachineCPU) -> float:
        """CPU seconds the machine had (all cores) since ``before``."""
        return (self.total - before.total) / CLOCK_TICKS


def wait_quiet(
    max_busy: float, *, window: float = 1.0, timeout: float = 60.0
) -> tuple[float, float]:
    """Wait until the machine is at most ``max_busy`` busy over a ``window``, at most
    ``timeout`` seconds: (the last window's busy share, seconds waited). On a machine
    shared with other work, a run started in a quiet moment is less disturbed."""
    started = time.monotonic()
    while True:
        before = MachineCPU.sample()
        time.sleep(window)
        busy = MachineCPU.sample().busy_share_since(before)
        waited = time.monotonic() - started
        if busy <= max_busy or waited >= timeout:
            return busy, waited

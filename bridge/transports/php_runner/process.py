"""One PHP runner process: Phorge bootstrapped once, tasks sent to it over a pipe.

The process is ``phorge-bridge-runner.php`` (shipped next to this module). Requests go
down a pipe and answers come back on another, each on a file descriptor of its own that
the command line names, as frames (a 4-byte big-endian length, then a JSON object), so
nothing a task prints can corrupt them: its stdout and
stderr go to a pipe of their own, logged line by line and kept for the reason when the
process dies. The process exits at the end of its request pipe, and is started under
``setpriv --pdeathsig KILL`` where that exists, so even a busy one dies with its worker.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import select
import shutil
import signal
import struct
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge.errors import RunnerBootError, RunnerDied, RunnerKilled, RunnerTimedOut
from bridge.phorge.extension import RUNNER_FILENAME, shipped_file

log = logging.getLogger(__name__)

HEADER = struct.Struct(">I")
OUTPUT_LINES_KEPT = 20
STOP_GRACE = 2.0  # seconds a process gets to exit at the end of its pipe
# Signals that come from outside the task (the OOM killer's SIGKILL, an operator's), as
# opposed to PHP's own crashes (SIGSEGV, SIGABRT, SIGBUS): see ``RunnerKilled``.
OUTSIDE_KILLS = frozenset({signal.SIGKILL, signal.SIGTERM})


@dataclass(frozen=True)
class RunnerCommand:
    """How to start a runner: the PHP binary and the Phorge checkout it bootstraps."""

    php: str
    phorge_root: Path

    def argv(self, requests_fd: int, answers_fd: int) -> list[str]:
        script = str(shipped_file(RUNNER_FILENAME))
        php = [self.php, script, str(self.phorge_root), str(requests_fd), str(answers_fd)]
        setpriv = shutil.which("setpriv")
        return [setpriv, "--pdeathsig", "KILL", *php] if setpriv else php


class RunnerProcess:
    """A runner; one request at a time (the pool hands it to one task at a time).

    Made, it is started and boots on its own; :meth:`ready` waits for the boot to end,
    so a pool can start its processes together and the first task finds them booted.
    Start it from a thread that lives as long as the worker process: with ``setpriv``,
    the process is killed when the thread that started it ends.
    """

    def __init__(self, command: RunnerCommand) -> None:
        if shutil.which(command.php) is None:
            raise RunnerBootError(f"the PHP binary {command.php!r} is not installed (not found)")
        self.born = time.time()  # wall clock: compared with a file's modification time
        self.tasks = 0
        self.php_version = ""
        self.output: collections.deque[str] = collections.deque(maxlen=OUTPUT_LINES_KEPT)
        requests_read, self._requests = os.pipe()
        self._answers, answers_write = os.pipe()
        # Only the child's ends are passed on; every other descriptor stays ours.
        try:
            self._proc = subprocess.Popen(
                command.argv(requests_read, answers_write),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(requests_read, answers_write),
            )
        except OSError as exc:
            for fd in (requests_read, answers_write, self._requests, self._answers):
                os.close(fd)
            raise RunnerBootError(f"cannot start {command.php}: {exc.strerror}") from None
        os.close(requests_read)
        os.close(answers_write)
        self.pid = self._proc.pid
        self._drain = threading.Thread(
            target=self._log_output, name=f"php-runner-{self.pid}-output", daemon=True
        )
        self._drain.start()

    def ready(self, timeout: float) -> None:
        """Wait until it has booted (at once when it has); raises :class:`RunnerBootError`
        saying why it could not."""
        if self.php_version:
            return
        try:
            answer = self._receive(time.monotonic() + timeout)
        except RunnerDied as exc:
            self.kill()
            raise RunnerBootError(str(exc)) from None
        if answer.get("type") != "ready":
            self.kill()
            raise RunnerBootError(str(answer.get("message") or answer))
        self.php_version = str(answer.get("php") or "?")

    def request(self, message: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        """Send one request and wait for its answer; past ``timeout`` seconds the process
        is killed. Raises :class:`RunnerDied` when it ends before answering."""
        body = json.dumps(message).encode()
        self.output.clear()  # what this request prints, for its reason
        try:
            _write_all(self._requests, HEADER.pack(len(body)) + body)
        except OSError:
            raise self._died("its request pipe was closed") from None
        deadline = None if timeout is None else time.monotonic() + timeout
        answer = self._receive(deadline)
        if answer.get("type") == "died":
            self._reap()
            raise RunnerDied(self._reason(str(answer.get("message")), str(answer.get("output"))))
        return answer

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def rss(self) -> int:
        """Resident memory in bytes (0 once gone), read from /proc: no request needed."""
        try:
            pages = Path(f"/proc/{self.pid}/statm").read_text().split()[1]
        except (OSError, IndexError):
            return 0
        return int(pages) * os.sysconf("SC_PAGE_SIZE")

    def stop(self) -> None:
        """End it the quiet way (its request pipe closed), killing it if it lingers."""
        self._close_requests()
        try:
            self._proc.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            self.kill()
        self._close_answers()

    def kill(self) -> None:
        if self.alive:
            self._proc.kill()
        self._reap()

    def _reap(self) -> None:
        self._close_requests()
        self._proc.wait()
        self._close_answers()
        self._drain.join(STOP_GRACE)

    def _close_requests(self) -> None:
        if self._requests >= 0:
            os.close(self._requests)
            self._requests = -1

    def _close_answers(self) -> None:
        if self._answers >= 0:
            os.close(self._answers)
            self._answers = -1

    def _receive(self, deadline: float | None) -> dict[str, Any]:
        header = self._read_exactly(HEADER.size, deadline)
        (length,) = HEADER.unpack(header)
        answer = json.loads(self._read_exactly(length, deadline))
        if not isinstance(answer, dict):
            raise self._died(f"it answered {type(answer).__name__}, not an object")
        return answer

    def _read_exactly(self, length: int, deadline: float | None) -> bytes:
        data = b""
        while len(data) < length:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and (
                wait <= 0 or not select.select([self._answers], [], [], wait)[0]
            ):
                self.kill()
                raise RunnerTimedOut(self._reason("it ran past its deadline and was killed"))
            chunk = os.read(self._answers, length - len(data))
            if not chunk:
                raise self._died("it ended without answering")
            data += chunk
        return data

    def _died(self, what: str) -> RunnerDied:
        self._reap()
        code = self._proc.returncode
        if code is not None and code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        reason = self._reason(f"{what}: PHP {how}", "\n".join(self.output))
        killed = code is not None and code < 0 and -code in OUTSIDE_KILLS
        return RunnerKilled(reason) if killed else RunnerDied(reason)

    def _reason(self, what: str, printed: str = "") -> str:
        text = f"PHP runner process {self.pid}: {what}"
        printed = printed.strip()
        return f"{text}; it printed: {printed[-1000:]}" if printed else text

    def _log_output(self) -> None:
        assert self._proc.stdout is not None
        with self._proc.stdout:
            for raw in self._proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                self.output.append(line)
                log.warning("PHP runner %s: %s", self.pid, line)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]

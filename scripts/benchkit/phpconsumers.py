"""The PHP section's consumers, and their CPU by process role.

One run's CPU is split by what each process is, since the point of the section is where
a PHP-only task's cost goes: ``phd PHP`` (the overseer and its daemon), ``bridge Python``
(the Celery worker's main process and its pool children), ``beat`` (the process ``-B``
forks; the bench's hook marks it, ``hook.BEAT_SUFFIX``), ``runner PHP`` (the bridge's
PHP runner processes, children of the pool processes, or of the main one with threads)
and ``web-tier PHP`` (``php -S`` and its workers). MariaDB, RabbitMQ and the bench
itself are sampled by the runner as for every scenario.

- ``PhpPhd``: ``bin/phd debug taskmaster`` x N, as ``consumers.Phd``.
- ``RunnerBridge``: the README's default command, ``celery -A bridge worker -B``
  (prefork, one process per core) with ``BRIDGE_PHORGE_ROOT`` set: PHP-only classes run
  in long-lived PHP processes, one per pool slot.
- ``ConduitBridge``: a web tier of its own (``webtier``), then ``celery -A bridge worker
  -B -P threads -c 8`` with ``BRIDGE_CONDUIT_URL``/``BRIDGE_CONDUIT_TOKEN`` and no
  ``BRIDGE_PHORGE_ROOT``: every task is a ``worker.execute`` request.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchkit import hook, procs, webtier
from benchkit.consumers import Bridge, Phd
from benchkit.php import PhpSetup
from benchkit.procs import ProcStat

PHD, PYTHON, BEAT, RUNNER, WEB = "phd PHP", "bridge Python", "beat", "runner PHP", "web-tier PHP"
ROLES = (PHD, PYTHON, BEAT, RUNNER, WEB)  # the report's order


def is_php(p: ProcStat) -> bool:
    """A PHP interpreter (``php``, ``php8.2``): the command name after exec."""
    return p.name.startswith("php")


def bridge_roles(table: dict[int, ProcStat], leader: int, beat_pids: set[int]) -> dict[str, float]:
    """CPU seconds of a bridge worker's family by role: PHP processes are the runner's,
    a marked beat process (never the worker's main process) is beat, the rest Python."""
    roles = dict.fromkeys((PYTHON, BEAT, RUNNER), 0.0)
    for p in procs.family(table, leader):
        if is_php(p):
            role = RUNNER
        elif p.pid in beat_pids and p.pid != leader:
            role = BEAT
        else:
            role = PYTHON
        roles[role] += p.cpu
    return roles


def beat_pids(records: Path | None) -> set[int]:
    """The processes the hook marked as an embedded beat (``<pid>.beat`` files)."""
    if records is None:
        return set()
    return {int(path.stem) for path in records.glob(f"*{hook.BEAT_SUFFIX}")}


@dataclass
class PhpPhd(Phd):
    """``bin/phd debug taskmaster`` x ``processes``; all of it is PHP."""

    def cpu(self) -> dict[str, float]:
        table = procs.scan()
        return {PHD: sum(procs.family_cpu(p.pid, table) for p in self.procs())}


@dataclass
class RunnerBridge(Bridge):
    """``celery -A bridge worker -B`` with the PHP runner on the copy."""

    setup: PhpSetup | None = None

    def start(self) -> None:
        assert self.setup is not None
        self.beat_in_worker = True
        self.overrides = {**self.overrides, "BRIDGE_PHORGE_ROOT": str(self.setup.root)}
        super().start()

    def cpu(self) -> dict[str, float]:
        return self.split(procs.scan())

    def split(self, table: dict[int, ProcStat]) -> dict[str, float]:
        """CPU seconds by role, from one scan of /proc."""
        beats = beat_pids(self.records)
        roles = dict.fromkeys((PYTHON, BEAT, RUNNER), 0.0)
        for worker in self.roles.get("workers", []):
            for role, seconds in bridge_roles(table, worker.pid, beats).items():
                roles[role] += seconds
        return roles


@dataclass
class ConduitBridge(RunnerBridge):
    """A web tier, then ``celery -A bridge worker -B -P threads -c 8`` through Conduit."""

    web: webtier.WebTier | None = None
    on_released: Callable[[], None] | None = None  # the ping scenario starts its pings
    opcache_after: dict[str, object] = field(default_factory=dict)
    requests_at_release: int = 0  # web requests served when the last batch was committed

    def start(self) -> None:
        assert self.setup is not None
        directory = Path(tempfile.mkdtemp(prefix="webtier-", dir=self.scratch))
        self.web = webtier.start(
            self.setup.root, self.setup.web_port, directory, webtier.environment()
        )
        self.roles["web"] = [self.web.proc]
        self.beat_in_worker = True
        self.overrides = {
            **self.overrides,
            "BRIDGE_CONDUIT_URL": self.web.url,
            "BRIDGE_CONDUIT_TOKEN": self.setup.token,
        }
        Bridge.start(self)  # not RunnerBridge's: no BRIDGE_PHORGE_ROOT here

    def released(self) -> None:
        self.requests_at_release = self.web_requests()
        if self.on_released is not None:
            self.on_released()

    def web_requests(self) -> int:
        """Requests the web tier has accepted so far (``php -S`` logs each one)."""
        return webtier.accepted(self.web.proc) if self.web is not None else 0

    def split(self, table: dict[int, ProcStat]) -> dict[str, float]:
        roles = super().split(table)
        roles.pop(RUNNER)  # none here: no BRIDGE_PHORGE_ROOT
        roles[WEB] = sum(procs.family_cpu(p.pid, table) for p in self.roles.get("web", []))
        return roles

    def stop(self) -> None:
        """The bridge first, then the web tier (asked how its opcache did, for the report)."""
        if self.web is not None and self.web.proc.alive():
            try:
                self.opcache_after = webtier.opcache_status(self.web.url)
            except Exception as exc:  # a report detail only; stopping must go on
                self.opcache_after = {"error": str(exc)[:200]}
        try:
            for proc in self.roles.get("workers", []):
                procs.stop(proc, first_signal=self.stop_signal)
        finally:
            for proc in self.roles.get("web", []):
                procs.stop(proc)

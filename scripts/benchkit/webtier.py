"""Phorge's web tier for the PHP section: ``php -S`` with opcache, and ``conduit.ping``.

The Conduit path runs every task as a web request, so what the bench measures there is
also what a web tier costs: the one here is PHP's built-in server with
``PHP_CLI_SERVER_WORKERS`` worker processes (forked after start, sharing one opcache)
and Phorge's rewrite rule as a router script (``php/router.php``). Opcache serves the
``cli-server`` SAPI only when ``opcache.enable_cli`` is on too (it counts as the CLI),
so both are passed; the router's ``/__bench/opcache`` answers ``opcache_get_status()``
and the bench refuses a web tier on which it is off, so "with opcache" is checked, not
assumed.

``conduit.ping`` needs no token: it is the plain web request whose latency the bench
compares, idle and during a drain through Conduit (``Pinger``).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from benchkit import procs
from benchkit.procs import BenchError
from benchkit.runner import Percentiles, Throughput

ROUTER = Path(__file__).resolve().parent / "php" / "router.php"
WORKERS = 4  # PHP_CLI_SERVER_WORKERS
OPCACHE_FLAGS = ("-d", "opcache.enable=1", "-d", "opcache.enable_cli=1")
START_TIMEOUT = 30.0
PING_EVERY = 0.05  # seconds from one ping's start to the next one's
PING_TIMEOUT = 60.0


@dataclass(frozen=True)
class WebTier:
    url: str  # the base URI, no trailing slash: what BRIDGE_CONDUIT_URL is set to
    proc: procs.Proc
    opcache: dict[str, Any]  # the router's /__bench/opcache answer at start


def command(root: Path, port: int) -> list[str]:
    return [
        "php",
        *OPCACHE_FLAGS,
        "-S",
        f"127.0.0.1:{port}",
        "-t",
        str(root / "webroot"),
        str(ROUTER),
    ]


def accepted(proc: procs.Proc) -> int:
    """Connections ``php -S`` has accepted: it logs an ``Accepted`` line for each, and
    each of the bridge's requests (and of the bench's pings) is one connection."""
    try:
        return proc.log.read_bytes().count(b" Accepted\n")
    except OSError:
        return 0


def opcache_status(url: str) -> dict[str, Any]:
    """One worker's opcache: ``enabled``, cached ``scripts``, ``hits``, ``misses``, ``sapi``."""
    answer = requests.get(f"{url}/__bench/opcache", timeout=10)
    answer.raise_for_status()
    status: dict[str, Any] = answer.json()
    return status


def start(root: Path, port: int, directory: Path, env: dict[str, str]) -> WebTier:
    """Serve the Phorge at ``root`` on 127.0.0.1:``port``; returns once it answers, with
    opcache on (else stops it and raises)."""
    env = {**env, "PHP_CLI_SERVER_WORKERS": str(WORKERS), "PHORGE_WEBROOT": str(root / "webroot")}
    proc = procs.start(
        "php -S", command(root, port), env=env, cwd=root, log=directory / "php-server.log"
    )
    url = f"http://127.0.0.1:{port}"
    status: dict[str, Any] = {}

    def answers() -> bool:
        nonlocal status
        try:
            status = opcache_status(url)
        except (requests.RequestException, ValueError):
            return False
        return True

    def alive() -> None:
        if not proc.alive():
            raise BenchError(f"php -S exited with {proc.popen.returncode}:\n{proc.tail()}")

    try:
        procs.wait_until(
            answers, timeout=START_TIMEOUT, what=f"php -S on port {port}", interval=0.1,
            check=alive,
        )  # fmt: skip
        if not status.get("enabled"):
            raise BenchError(
                f"opcache is off in the web tier ({status}): {' '.join(command(root, port))}"
            )
    except BaseException:
        procs.stop(proc)
        raise
    return WebTier(url, proc, status)


def ping(session: requests.Session, url: str) -> float:
    """Seconds one ``conduit.ping`` took (raises on anything but a Conduit success)."""
    started = time.perf_counter()
    answer = session.post(
        f"{url}/api/conduit.ping",
        data={"params": "{}", "output": "json"},
        timeout=PING_TIMEOUT,
    )
    took = time.perf_counter() - started
    answer.raise_for_status()
    envelope = answer.json()
    if envelope.get("error_code"):
        raise BenchError(f"conduit.ping: {envelope['error_code']}: {envelope.get('error_info')}")
    return took


def pings(url: str, count: int, every: float = PING_EVERY) -> list[float]:
    """``count`` sequential pings, one every ``every`` s (or as soon as the last ends)."""
    session = requests.Session()
    found = []
    for _ in range(count):
        started = time.monotonic()
        found.append(ping(session, url))
        time.sleep(max(0.0, every - (time.monotonic() - started)))
    return found


@dataclass
class Pinger:
    """Sequential pings on a thread of the bench, from :meth:`begin` to :meth:`end`."""

    url: str
    every: float = PING_EVERY
    took: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def begin(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pinger", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        session = requests.Session()
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.took.append(ping(session, self.url))
            except (requests.RequestException, ValueError, BenchError) as exc:
                self.errors.append(str(exc)[:200])
            self._stop.wait(max(0.0, self.every - (time.monotonic() - started)))

    def end(self) -> list[float]:
        """Stop after the ping in flight; the seconds each ping took."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=PING_TIMEOUT + 5)
        return list(self.took)


@dataclass
class PingRun:
    """``conduit.ping`` seconds idle (before the drain) and during a drain through Conduit."""

    idle: list[float]
    during: list[float]
    errors: list[str] = field(default_factory=list)  # pings during the drain that failed

    @property
    def idle_p(self) -> Percentiles | None:
        return Percentiles.of(self.idle)

    @property
    def during_p(self) -> Percentiles | None:
        return Percentiles.of(self.during)

    @property
    def ratio(self) -> float | None:
        """p95 during the drain over p95 idle (issue 19: at most 2)."""
        idle, during = self.idle_p, self.during_p
        if idle is None or during is None or not idle.p95:
            return None
        return during.p95 / idle.p95


def ping_during(
    url: str, idle_count: int, drain: Callable[[Callable[[], None]], Throughput]
) -> tuple[PingRun, Throughput]:
    """``idle_count`` pings, then pings while ``drain`` runs: ``drain(begin)`` must call
    ``begin`` as its batch is committed, and return the drain's figures."""
    idle = pings(url, idle_count)
    pinger = Pinger(url)
    try:
        throughput = drain(pinger.begin)
    finally:
        during = pinger.end()
    return PingRun(idle, during, pinger.errors), throughput


def free_port_error(port: int) -> str | None:
    """Why ``port`` cannot be the web tier's, or None when it is free on 127.0.0.1."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            return f"port {port} is taken ({exc.strerror}): pass --web-port"
    return None


def environment() -> dict[str, str]:
    """The web tier's environment: the bench's, without anything naming another Phorge."""
    return {k: v for k, v in os.environ.items() if k not in ("PHABRICATOR_ENV", "PHORGE_ROOT")}

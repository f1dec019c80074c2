"""A Redis database of its own for each live bridge deployment under test.

A deployment on Redis gets a database number of its own: kombu keeps its fanout (events,
pidbox) apart per database, so two deployments sharing one would hear each other's
broadcasts. :class:`RedisDatabases` hands numbers 1-15 out in order (0 holds the claims)
and *claims* each one while its deployment lives: the key ``phorge-bridge-test:database:N``
in database 0, set with ``SET NX`` and an expiry of :data:`CLAIM_TTL` that a thread of
this process renews every quarter of it, deleted at the release. So:

- two live deployments never share a database, in one process or in two pytest
  processes on the same Redis (the real-Phorge tier beside the main suite, two
  checkouts); a process that dies leaves its claims to expire within ``CLAIM_TTL``;
- a database is flushed when claimed (whatever a dead run left in it goes), so a number
  is reused cleanly once released: more than 15 deployments in a run is fine as long as
  no more than 15 live at once (a claim waits up to :data:`CLAIM_WAIT` for one to be
  released, then fails naming the holders).
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
import time

import redis

DATABASES = range(1, 16)  # Redis' default 16 databases; 0 holds the claims
CLAIM_KEY = "phorge-bridge-test:database:{}"
CLAIM_TTL = 120  # seconds a claim outlives a process that died holding it
CLAIM_WAIT = 120.0
_REFRESH = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('expire', KEYS[1], ARGV[2]) end
return redis.call('set', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) and 1 or 0
"""
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('del', KEYS[1]) end"


def _client(server: str, number: int = 0) -> redis.Redis:
    return redis.Redis.from_url(f"{server}/{number}", socket_timeout=10, socket_connect_timeout=10)


class RedisDatabases:
    """Claims of database numbers on Redis servers (``redis://host:port``), for this process."""

    def __init__(self) -> None:
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._lock = threading.Lock()
        self._held: set[tuple[str, int]] = set()
        self._next: dict[str, int] = {}  # server -> the index to try first
        self._renewer: threading.Thread | None = None

    def claim(self, server: str) -> int:
        """A database number of ``server`` claimed for this process, flushed."""
        deadline = time.monotonic() + CLAIM_WAIT
        claims = _client(server)
        try:
            while True:
                number = self._try(server, claims)
                if number is not None:
                    _client(server, number).flushdb()
                    return number
                if time.monotonic() > deadline:
                    holders = claims.mget([CLAIM_KEY.format(n) for n in DATABASES])
                    raise RuntimeError(
                        f"no database of {server} free within {CLAIM_WAIT:.0f} s: {holders}"
                    )
                time.sleep(0.5)
        finally:
            claims.close()

    def _try(self, server: str, claims: redis.Redis) -> int | None:
        with self._lock:
            first = self._next.get(server, 0)
            for step in range(len(DATABASES)):
                index = (first + step) % len(DATABASES)
                number = DATABASES[index]
                if (server, number) in self._held:
                    continue
                if claims.set(CLAIM_KEY.format(number), self.owner, nx=True, ex=CLAIM_TTL):
                    self._held.add((server, number))
                    self._next[server] = index + 1
                    self._start_renewer()
                    return number
        return None

    def release(self, server: str, number: int) -> None:
        with self._lock:
            self._held.discard((server, number))
        try:
            with _client(server) as claims:
                claims.eval(_RELEASE, 1, CLAIM_KEY.format(number), self.owner)
        except redis.RedisError as exc:  # it expires anyway
            print(f"could not release Redis database {number}: {exc}", file=sys.stderr)

    def _start_renewer(self) -> None:
        if self._renewer is None:
            self._renewer = threading.Thread(target=self._renew, name="redis-claims", daemon=True)
            self._renewer.start()

    def _renew(self) -> None:
        while True:
            time.sleep(CLAIM_TTL / 4)
            with self._lock:
                held = sorted(self._held)
            for server, number in held:
                try:  # a private Redis a fault test stopped is down for a while
                    with _client(server) as claims:
                        kept = claims.eval(
                            _REFRESH, 1, CLAIM_KEY.format(number), self.owner, CLAIM_TTL
                        )
                except redis.RedisError:
                    continue
                if not kept:
                    print(f"Redis database {number} of {server}: claim lost", file=sys.stderr)


REDIS_DATABASES = RedisDatabases()

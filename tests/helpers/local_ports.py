"""Ports on 127.0.0.1 for the servers the tests start, never the same one twice.

Probing for a free port (bind port 0, read it, close) and handing the number out races:
the kernel may give the same port to the next probe, to a connection's source port, or to
another process before the server binds it, so two servers could get one port. Instead:

- A server that can bind port 0 itself and say which port it got is given 0 (the fake
  Conduit servers of ``conduit_fakes.FakeServer``).
- A process that must be told its port up front (a worker's ``BRIDGE_METRICS_PORT``,
  Prometheus' listen address, the fault suite's private servers) gets a *claimed* one,
  :func:`free_port`. A port is claimed by an exclusive ``flock`` on
  ``/tmp/phorge-bridge-ports/PORT.lock`` held until the claiming process exits (the
  kernel drops it then, even after SIGKILL): two pytest processes on the machine (the
  main suite beside the real-Phorge tier, two checkouts) never claim the same port, and
  one process never hands a port out twice. Claimed ports are taken from a range below
  the kernel's ephemeral range (``net.ipv4.ip_local_port_range``, 32768 and up by
  default), which it never picks for a port-0 bind or a connection's source port, so
  between the claim and the child's bind only a process naming that very port could take
  it; a bind check at the claim skips any port something already holds.
- A port nothing listens on (a "Conduit is unreachable" case) is :func:`closed_port`: a
  socket bound and never listening, held until the process exits, so a connection is
  refused and nothing else can bind the port meanwhile.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

LOCKS = Path("/tmp/phorge-bridge-ports")
# Below the ephemeral range; clear of the services' ports (3307, 3309, 3317-, 5672, 5682-,
# 6379, 6389-, 8766, 15672) and RabbitMQ's distribution ports (AMQP port + 20000: 25672-).
CLAIMED = range(27000, 32000)
_held: dict[int, int] = {}  # port -> the fd of its lock, open until the process exits
_closed: list[socket.socket] = []
_cursor = (os.getpid() * 97) % len(CLAIMED)  # processes start apart: fewer lock misses


def _bindable(port: int) -> bool:
    """Nothing holds ``port`` on 127.0.0.1 now (no SO_REUSEADDR: a TIME_WAIT counts)."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _lock(port: int) -> bool:
    """Claim ``port`` for this process (False when another process claimed it)."""
    if port in _held:
        return False
    LOCKS.mkdir(exist_ok=True)
    fd = os.open(LOCKS / f"{port}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _held[port] = fd
    return True


def claim_port(first: int, *, offsets: tuple[int, ...] = (0,), tries: int = 100) -> int:
    """The first port from ``first`` that this process could claim, with ``port + offset``
    claimed too for each offset (RabbitMQ's distribution port), all of them bindable."""
    for port in range(first, first + tries):
        wanted = [port + offset for offset in offsets]
        if any(p in _held for p in wanted):
            continue
        got = []
        for p in wanted:
            if not _lock(p):
                break
            got.append(p)
        if len(got) == len(wanted) and all(_bindable(p) for p in wanted):
            return port
        for p in got:  # not all of them: give back what was claimed for this port
            os.close(_held.pop(p))
    raise RuntimeError(f"no claimable port from {first} (claims: {LOCKS})")


def free_port(count: int = 1) -> int:
    """A claimed port for a server started next, never handed out again on this machine
    while this process lives; ``count`` > 1: the first of that many consecutive ones."""
    global _cursor
    for _ in range(len(CLAIMED)):
        port = CLAIMED[_cursor]
        _cursor = (_cursor + count) % len(CLAIMED)
        if port + count - 1 in CLAIMED:
            try:
                return claim_port(port, offsets=tuple(range(count)), tries=1)
            except RuntimeError:
                continue
    raise RuntimeError(f"every port of {CLAIMED} is claimed (claims: {LOCKS})")


def closed_port() -> int:
    """A port on 127.0.0.1 that refuses connections for the rest of the process: bound by
    a socket that never listens (no other socket can bind it meanwhile)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _closed.append(sock)
    return int(sock.getsockname()[1])

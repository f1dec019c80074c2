"""Which leases a warm shutdown hands back: every task of the messages not yet started."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bridge.queue import Lease
from bridge.runtime import lifecycle


@dataclass(frozen=True, eq=False)  # hashed by identity, as Celery's requests are
class Request:
    name: str
    args: tuple[Any, ...]


def request(name: str, *args: Any) -> Request:
    return Request(name, args)


def test_unstarted_single_and_batch_messages_give_back_every_task_lease(monkeypatch):
    running = request("bridge.execute", 1, "bridge:a", 0)
    single = request("bridge.execute", 2, "bridge:a", 1, '{"n": 1}', "Worker")
    batch = request(
        "bridge.execute_batch", "bridge:b", [[3, 0, "Worker", None], [4, 2, "Worker", "{}"]]
    )
    poll = request("bridge.poll")
    monkeypatch.setattr(lifecycle.state, "reserved_requests", {running, single, batch, poll})
    monkeypatch.setattr(lifecycle.state, "active_requests", {running})
    assert sorted(lifecycle.unstarted_leases()) == [
        Lease(2, "bridge:a", 1),
        Lease(3, "bridge:b", 0),
        Lease(4, "bridge:b", 2),
    ]

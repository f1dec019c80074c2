"""The Conduit fakes the other tests stand on (tests/helpers/conduit_fakes.py)."""

from __future__ import annotations

import json

import requests
from conduit_fakes import FakeServer, Reply, conduit_error, conduit_result


def test_fake_server_records_and_replies() -> None:
    with FakeServer(lambda r: Reply(201, b"made", {"X-Test": "1"})) as server:
        response = requests.post(server.url + "/x", data={"a": "1 2"}, timeout=5)
    assert (response.status_code, response.content, response.headers["X-Test"]) == (
        201,
        b"made",
        "1",
    )
    assert server.requests[0].path == "/x"
    assert server.requests[0].form == {"a": ["1 2"]}


def test_fake_conduit_envelopes() -> None:
    assert json.loads(conduit_result({"a": 1}).body) == {
        "result": {"a": 1},
        "error_code": None,
        "error_info": None,
    }
    assert json.loads(conduit_error("ERR-X", "no").body)["error_code"] == "ERR-X"

"""ConduitClient against a real local HTTP server speaking Conduit, and ConduitSettings."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from conduit_fakes import TOKEN, FakeServer, Reply, conduit_error, conduit_result
from local_ports import closed_port

from bridge.config import ConduitSettings, ConfigError, load_settings
from bridge.errors import (
    ConduitAuthError,
    ConduitError,
    ConduitMethodNotFoundError,
    ConduitTimeoutError,
    ConduitTransportError,
)
from bridge.transports.conduit.client import AUTH_ERROR_CODES, ConduitClient


def client_for(server: FakeServer, **kwargs: float) -> ConduitClient:
    return ConduitClient(server.url, TOKEN, **kwargs)


def call_error(reply: Reply, expected: type[ConduitError] = ConduitError) -> ConduitError:
    """Call worker.execute against a server answering ``reply``; return the raised error."""
    with FakeServer(lambda request: reply) as server:
        try:
            client_for(server).call("worker.execute", {})
        except ConduitError as exc:
            assert isinstance(exc, expected), exc
            return exc
    raise AssertionError("no ConduitError raised")


# -- the request, field by field ------------------------------------------------------------


def test_request_is_phorges_wire_format() -> None:
    with FakeServer(lambda r: conduit_result({"ok": True})) as server:
        result = client_for(server).call("worker.execute", {"taskID": 7, "data": '{"a":1}'})
    assert result == {"ok": True}
    (request,) = server.requests
    assert request.method == "POST"
    assert request.path == "/api/worker.execute"
    assert request.headers["content-type"] == "application/x-www-form-urlencoded"
    form = request.form
    assert sorted(form) == ["__conduit__", "output", "params"]
    assert form["output"] == ["json"]
    assert form["__conduit__"] == ["1"]
    params = request.params
    assert params["__conduit__"] == {"token": TOKEN}
    assert params["taskID"] == 7
    # The raw data string travels as a JSON string, not re-decoded.
    assert params["data"] == '{"a":1}'
    assert set(params) == {"__conduit__", "taskID", "data"}


def test_base_url_path_and_trailing_slash() -> None:
    with FakeServer(lambda r: conduit_result(1)) as server:
        ConduitClient(server.url + "/phorge/", TOKEN).call("conduit.ping")
    assert server.requests[0].path == "/phorge/api/conduit.ping"


def test_big_integers_survive_both_ways() -> None:
    key = 7713765376809813936  # > 2**53, a real chronological key
    with FakeServer(lambda r: Reply(body=b'{"result":{"key":%d},"error_code":null}' % key)) as s:
        result = client_for(s).call("worker.feedstory", {"key": key})
    assert result == {"key": key}
    assert s.requests[0].params["key"] == key


def test_params_may_not_smuggle_conduit_metadata() -> None:
    client = ConduitClient("http://127.0.0.1:9", TOKEN)
    with pytest.raises(ValueError):
        client.call("conduit.ping", {"__conduit__": {"token": "x"}})
    with pytest.raises(ValueError):
        client.call("../admin", {})


# -- errors Phorge reports ------------------------------------------------------------------


@pytest.mark.parametrize("code", sorted(AUTH_ERROR_CODES))
def test_auth_error_codes(code: str) -> None:
    error = call_error(conduit_error(code, "denied"), ConduitAuthError)
    assert error.error_code == code
    assert error.error_info == "denied"
    assert code in str(error)


def test_rejected_token_is_scrubbed_from_messages(caplog: pytest.LogCaptureFixture) -> None:
    # Phorge's own text for a bad token repeats it.
    info = f'API token "{TOKEN}" is not valid.'
    caplog.set_level(logging.DEBUG)
    with FakeServer(lambda r: conduit_error("ERR-INVALID-AUTH", info)) as server:
        client = client_for(server)
        with pytest.raises(ConduitAuthError) as exc:
            client.call("worker.execute", {})
    assert TOKEN not in str(exc.value)
    assert TOKEN not in (exc.value.error_info or "")
    assert "redacted" in str(exc.value)
    assert TOKEN not in repr(client)
    assert TOKEN not in caplog.text


def test_other_conduit_errors() -> None:
    error = call_error(conduit_error("ERR-CONDUIT-CORE", "boom"))
    assert type(error) is ConduitError
    assert (error.error_code, error.error_info) == ("ERR-CONDUIT-CORE", "boom")


def test_missing_method() -> None:
    message = 'Conduit API method "worker.execute" does not exist.'
    call_error(conduit_error("ERR-CONDUIT-CALL", message), ConduitMethodNotFoundError)


# -- transport problems ---------------------------------------------------------------------

HTML_500 = b"""<!DOCTYPE html><html><head><title>Unhandled Exception</title>
<style>body { color: red }</style></head><body><h1>Unhandled Exception</h1>
<p>Database connection failed: Too many connections</p></body></html>"""


def test_html_error_page() -> None:
    error = call_error(Reply(500, HTML_500, {"Content-Type": "text/html"}), ConduitTransportError)
    message = str(error)
    assert isinstance(error, ConduitTransportError) and error.http_status == 500
    assert "HTTP 500" in message
    assert "Database connection failed: Too many connections" in message
    assert "<" not in message and "color: red" not in message


def test_proxy_502_and_long_bodies_are_cut() -> None:
    body = b"<html><body>Bad Gateway " + b"x" * 5000 + b"</body></html>"
    message = str(call_error(Reply(502, body), ConduitTransportError))
    assert "HTTP 502" in message and "Bad Gateway" in message
    assert len(message) < 400


def test_200_with_html_is_not_conduit() -> None:
    reply = Reply(200, b"<html><body>Login required</body></html>")
    message = str(call_error(reply, ConduitTransportError))
    assert "HTTP 200" in message and "not a Conduit JSON response" in message
    assert "Login required" in message


def test_json_that_is_not_an_envelope() -> None:
    call_error(Reply(200, b"[1, 2]"), ConduitTransportError)


def test_json_shield_is_accepted() -> None:
    body = b'for (;;);{"result":3,"error_code":null,"error_info":null}'
    with FakeServer(lambda r: Reply(200, body)) as server:
        assert client_for(server).call("conduit.ping") == 3


def test_redirects_are_reported_not_followed() -> None:
    location = "https://elsewhere.example/api/x"
    server = FakeServer(lambda r: Reply(301, b"", {"Location": location}))
    with server, pytest.raises(ConduitTransportError, match=r"redirect .* to https://elsewhere"):
        client_for(server).call("worker.execute", {})
    assert len(server.requests) == 1


def test_slow_response_times_out() -> None:
    with FakeServer(
        lambda r: conduit_result(1) if r.path.endswith("fast") else Reply(delay=2)
    ) as s:
        client = client_for(s, read_timeout=0.3)
        started = time.monotonic()
        with pytest.raises(ConduitTimeoutError) as info:
            client.call("worker.execute", {})
        assert time.monotonic() - started < 1.5
        assert "timed out" in str(info.value)
        # A per-call read timeout overrides the client's.
        with pytest.raises(ConduitTimeoutError):
            client.call("worker.execute", {}, read_timeout=0.2)
        assert client.call("x.fast", {}) == 1


def test_connection_refused() -> None:
    client = ConduitClient(f"http://127.0.0.1:{closed_port()}", TOKEN, connect_timeout=1)
    with pytest.raises(ConduitTransportError) as info:
        client.call("worker.execute", {})
    assert "unreachable" in str(info.value)
    assert TOKEN not in str(info.value)


def test_tls_verification_is_passed_to_requests() -> None:
    seen: list[object] = []

    class Session:
        def post(self, url: str, **kwargs: object) -> object:
            seen.append(kwargs["verify"])
            raise ConduitError("x", "stop")

    for verify in (True, False):
        client = ConduitClient(
            "https://phorge.example", TOKEN, verify_tls=verify, session=Session()
        )
        with pytest.raises(ConduitError):
            client.call("conduit.ping")
    assert seen == [True, False]


# -- settings -------------------------------------------------------------------------------

BASE_ENV = {"BRIDGE_CONDUIT_URL": "https://phorge.example.com/", "BRIDGE_CONDUIT_TOKEN": TOKEN}


def test_settings_not_configured() -> None:
    assert load_settings({}).conduit is None


def test_settings_defaults() -> None:
    settings = load_settings(BASE_ENV).conduit
    assert settings == ConduitSettings("https://phorge.example.com", TOKEN, 5.0, 600.0, True)
    assert TOKEN not in repr(settings)


def test_settings_full(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    settings = load_settings(
        {
            "BRIDGE_CONDUIT_URL": "http://127.0.0.1:8080/phorge",
            "BRIDGE_CONDUIT_TOKEN_FILE": str(token_file),
            "BRIDGE_CONDUIT_CONNECT_TIMEOUT": "2.5",
            "BRIDGE_CONDUIT_READ_TIMEOUT": "30",
            "BRIDGE_CONDUIT_VERIFY_TLS": "no",
        }
    ).conduit
    assert settings is not None
    assert (settings.url, settings.token) == ("http://127.0.0.1:8080/phorge", TOKEN)
    assert (settings.connect_timeout, settings.read_timeout, settings.verify_tls) == (
        2.5,
        30.0,
        False,
    )
    client = ConduitClient.from_settings(settings)
    assert (client.base_url, client.read_timeout, client.verify_tls) == (
        "http://127.0.0.1:8080/phorge",
        30.0,
        False,
    )


@pytest.mark.parametrize(
    ("env", "setting"),
    [
        ({"BRIDGE_CONDUIT_URL": "https://p.example"}, "BRIDGE_CONDUIT_TOKEN"),
        ({"BRIDGE_CONDUIT_TOKEN": TOKEN}, "BRIDGE_CONDUIT_URL"),
        ({**BASE_ENV, "BRIDGE_CONDUIT_URL": "ftp://p.example"}, "BRIDGE_CONDUIT_URL"),
        ({**BASE_ENV, "BRIDGE_CONDUIT_URL": "p.example"}, "BRIDGE_CONDUIT_URL"),
        ({**BASE_ENV, "BRIDGE_CONDUIT_URL": "https://p.example/api/"}, "BRIDGE_CONDUIT_URL"),
        ({**BASE_ENV, "BRIDGE_CONDUIT_URL": "https://u:p@p.example"}, "BRIDGE_CONDUIT_URL"),
        ({**BASE_ENV, "BRIDGE_CONDUIT_TOKEN": "api-short"}, "BRIDGE_CONDUIT_TOKEN"),
        ({**BASE_ENV, "BRIDGE_CONDUIT_TOKEN": "xyz-" + "a" * 28}, "BRIDGE_CONDUIT_TOKEN"),
        ({**BASE_ENV, "BRIDGE_CONDUIT_TOKEN_FILE": "/x"}, "BRIDGE_CONDUIT_TOKEN_FILE"),
        ({**BASE_ENV, "BRIDGE_CONDUIT_CONNECT_TIMEOUT": "0"}, "BRIDGE_CONDUIT_CONNECT_TIMEOUT"),
        ({**BASE_ENV, "BRIDGE_CONDUIT_READ_TIMEOUT": "soon"}, "BRIDGE_CONDUIT_READ_TIMEOUT"),
        ({**BASE_ENV, "BRIDGE_CONDUIT_READ_TIMEOUT": "inf"}, "BRIDGE_CONDUIT_READ_TIMEOUT"),
        ({**BASE_ENV, "BRIDGE_CONDUIT_VERIFY_TLS": "maybe"}, "BRIDGE_CONDUIT_VERIFY_TLS"),
    ],
)
def test_settings_errors_name_the_setting(env: dict[str, str], setting: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    assert info.value.setting == setting
    assert str(info.value).startswith(f"{setting}: ")
    assert TOKEN not in str(info.value)


def test_unreadable_token_file(tmp_path: Path) -> None:
    env = {"BRIDGE_CONDUIT_URL": "https://p.example", "BRIDGE_CONDUIT_TOKEN_FILE": str(tmp_path)}
    with pytest.raises(ConfigError, match="BRIDGE_CONDUIT_TOKEN_FILE: cannot read"):
        load_settings(env)


def test_a_bad_token_in_its_file_names_the_file_setting(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("api-short\n")
    env = {"BRIDGE_CONDUIT_URL": "https://p.example", "BRIDGE_CONDUIT_TOKEN_FILE": str(token_file)}
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    assert info.value.setting == "BRIDGE_CONDUIT_TOKEN_FILE"
    assert "not a Phorge API token" in str(info.value)


def test_the_client_checks_what_it_is_given() -> None:
    with pytest.raises(ValueError, match="read_timeout"):
        ConduitClient.from_settings(ConduitSettings("https://p.example", TOKEN, read_timeout=-1))
    with pytest.raises(ValueError, match="not a Phorge API token"):
        ConduitClient("https://p.example", "nope")

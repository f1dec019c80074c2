"""Native FeedPublisherHTTPWorker: PHP-identical bodies, status classes, allow-list, silence.

The http_build_query comparisons run the real ``php`` binary (php-cli, installed by the
test script); without it these tests fail rather than skip.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import socket
import subprocess
from typing import Any

import pytest
from conduit_fakes import TOKEN, FakeServer, Reply, conduit_error, conduit_result

from bridge.handlers.api import PermanentFailure, TaskContext, TemporaryFailure, Yield
from bridge.phorge.php import http_build_query, php_float_to_string, php_urlencode
from bridge.transports.conduit.client import ConduitClient
from bridge.transports.conduit.feed import FeedPublisherHTTPHandler, redact_uri, retry_wait

KEY = 7713765376809813936

STORY_DATA = {
    "objectPHID": "PHID-TASK-kd3x5oqw2z2ah6u7lrvy",
    "transactionPHIDs": {"PHID-XACT-TASK-a": "PHID-XACT-TASK-a", "PHID-XACT-TASK-b": None},
    "nested": {"list": [1, 2, [3, {"deep": "yes & no"}]], "empty": [], "none": None},
    "flags": {"true": True, "false": False},
    "numbers": [0, -1, KEY, 1.0, 0.5, 1e25, 1.5e-7, -0.0, 0.1 + 0.2],
    "text": "Grüße ~ *stars* a+b=c / 100% \"quoted\" 'single' <tag> \n\ttab 🎉",
    "keys with spaces": {"[brackets]": "x", "a=b&c": "y", "ü": "z"},
}

STORY = {
    "storyID": "123",
    "storyType": "PhabricatorApplicationTransactionFeedStory",
    "storyData": STORY_DATA,
    "storyAuthorPHID": "PHID-USER-abcdefghijklmnopqrst",
    "storyText": "alice created T1: Fix the ~thing~ (50% done).",
    "epoch": "1700000000",
}


def php_binary() -> str:
    php = shutil.which("php")
    if php is None:
        pytest.fail("php is not installed (apt-get install -y php-cli): these tests need it")
    return php


def php_eval(code: str, stdin: str, precision: int = 14) -> str:
    completed = subprocess.run(
        [php_binary(), "-n", "-d", f"precision={precision}", "-r", code],
        input=stdin.encode(),
        capture_output=True,
        check=True,
        timeout=60,
    )
    return completed.stdout.decode()


def php_http_build_query_many(cases: list[Any], precision: int = 14) -> list[str]:
    """PHP's http_build_query of each case, after PHP's own json_decode(..., true)."""
    code = (
        "$cases = json_decode(stream_get_contents(STDIN), true);"
        "$out = array();"
        'foreach ($cases as $case) { $out[] = http_build_query($case, "", "&"); }'
        "echo json_encode($out);"
    )
    return json.loads(php_eval(code, json.dumps(cases), precision))


# -- http_build_query, byte for byte against PHP ---------------------------------------------


def test_story_body_matches_php() -> None:
    (expected,) = php_http_build_query_many([STORY])
    assert http_build_query(STORY) == expected
    assert "storyData%5Bnested%5D%5Blist%5D%5B2%5D%5B1%5D%5Bdeep%5D=yes+%26+no" in expected


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["str", "int", "float", "bool", "null"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        alphabet = "aZ09 -_.~!*'()&=+%/?#[]\"<>\n\tüß€🎉"
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
    if kind == "int":
        return rng.choice([0, 1, -1, rng.randint(-(2**63), 2**63 - 1), rng.randint(0, 1000)])
    if kind == "float":
        return rng.choice(
            [
                rng.uniform(-1e6, 1e6),
                rng.random() * 10 ** rng.randint(-12, 25),
                float(rng.randint(0, 10**6)),
                rng.random(),
            ]
        )
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["k", "a b", "ü", "x[y]", "1", "0", "-", "~", "a&b"]
    return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


@pytest.mark.parametrize("precision", [14, 17, -1])
def test_random_data_matches_php(precision: int) -> None:
    rng = random.Random(4 + precision)
    cases = [{"storyData": random_value(rng), "epoch": rng.randint(0, 2**31)} for _ in range(400)]
    expected = php_http_build_query_many(cases, precision)
    assert [http_build_query(case, precision=precision) for case in cases] == expected


def test_floats_match_php() -> None:
    values = [
        0.0, -0.0, 1.0, -1.0, 0.1, 0.5, 1 / 3, 2 / 3, 100.0, 1e13, 1e14, 1e15, 1e16, 1e17,
        1e-4, 1e-5, 1.5e-7, 123456789.123456789, 1e25, 1.7976931348623157e308, 5e-324,
        0.30000000000000004, 99999999999999.99, 999999999999999.9, 12345678901234567890.0,
    ]  # fmt: skip
    rng = random.Random(7)
    values += [rng.uniform(-1, 1) * 10 ** rng.randint(-20, 20) for _ in range(300)]
    for precision in (14, 17, 5, -1):
        code = (
            "$out = array(); foreach (json_decode(stream_get_contents(STDIN)) as $v) "
            '{ $out[] = http_build_query(array("v" => (float)$v), "", "&"); } '
            "echo json_encode($out);"
        )
        expected = json.loads(php_eval(code, json.dumps(values), precision))
        got = ["v=" + php_urlencode(php_float_to_string(v, precision)) for v in values]
        assert got == expected, precision


def test_special_floats() -> None:
    assert php_float_to_string(math.inf) == "INF"
    assert php_float_to_string(-math.inf) == "-INF"
    assert php_float_to_string(math.nan) == "NAN"


def test_urlencode_matches_php() -> None:
    text = "".join(chr(c) for c in range(1, 256)) + " ~🎉"
    expected = php_eval("echo urlencode(stream_get_contents(STDIN));", text)
    assert php_urlencode(text) == expected


# -- the handler ------------------------------------------------------------------------------

HOOK_PATH = "/hook?secret=s3cr3t"


def make_task(
    uri: str, failure_count: int = 0, key: Any = KEY, traceparent: str | None = None
) -> TaskContext:
    return TaskContext(
        id=9,
        task_class="FeedPublisherHTTPWorker",
        data={"key": key, "uri": uri},
        failure_count=failure_count,
        priority=2000,
        raw_data=json.dumps({"key": key, "uri": uri}),
        traceparent=traceparent,
    )


class Setup:
    """A fake Phorge (worker.feedstory) and a hook receiver, both real local servers."""

    def __init__(
        self,
        hook_reply: Reply | None = None,
        *,
        silent: bool = False,
        story: dict[str, Any] | None = STORY,
        allow: bool = True,
        conduit_reply: Reply | None = None,
        user_agent: str | None = None,
    ) -> None:
        self.hook = FakeServer(lambda request: hook_reply or Reply(200, b"ok"))
        self.silent, self.story, self.allow = silent, story, allow
        self.user_agent = user_agent
        self.conduit_reply = conduit_reply
        self.phorge = FakeServer(self.answer)

    @property
    def uri(self) -> str:
        return self.hook.url + HOOK_PATH

    def answer(self, request: Any) -> Reply:
        if self.conduit_reply is not None:
            return self.conduit_reply
        return conduit_result(
            {
                "key": request.params["key"],
                "silent": self.silent,
                "hookURIs": [self.uri] if self.allow else ["https://other.example/"],
                "story": self.story,
                **({"userAgent": self.user_agent} if self.user_agent else {}),
            }
        )

    def run(self, failure_count: int = 0, timeout: float = 5.0, task: Any = None) -> Any:
        with self.hook, self.phorge:
            handler = FeedPublisherHTTPHandler(
                ConduitClient(self.phorge.url, TOKEN), timeout=timeout
            )
            try:
                handler.run(task or make_task(self.uri, failure_count))
            except Exception as exc:
                return exc
        return None


def test_delivers_the_php_body() -> None:
    setup = Setup()
    assert setup.run() is None
    (conduit_request,) = setup.phorge.requests
    assert conduit_request.path == "/api/worker.feedstory"
    # The chronological key travels as a string: it does not fit a double.
    assert conduit_request.params["key"] == str(KEY)
    (hook_request,) = setup.hook.requests
    assert hook_request.method == "POST"
    assert hook_request.path == HOOK_PATH
    assert hook_request.headers["content-type"] == "application/x-www-form-urlencoded"
    (expected,) = php_http_build_query_many([STORY])
    assert hook_request.body == expected.encode()


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_sends_phps_user_agent_and_the_trace_context() -> None:
    setup = Setup(user_agent="Arcanist/1.0 cURL/7.88.1")
    assert setup.run(task=make_task(setup.uri, traceparent=TRACEPARENT)) is None
    (hook_request,) = setup.hook.requests
    assert hook_request.headers["user-agent"] == "Arcanist/1.0 cURL/7.88.1"
    assert hook_request.headers["accept"] == "*/*"
    assert hook_request.headers["traceparent"] == TRACEPARENT


def test_an_older_extension_still_gets_phorges_client_name() -> None:
    setup = Setup()
    assert setup.run() is None
    (hook_request,) = setup.hook.requests
    assert hook_request.headers["user-agent"] == "Arcanist/1.0"
    assert "traceparent" not in hook_request.headers


def test_silenced_hooks_send_nothing() -> None:
    setup = Setup(silent=True)
    assert setup.run() is None
    assert setup.hook.requests == []


def test_missing_story_fails_permanently() -> None:
    setup = Setup(story=None)
    error = setup.run()
    assert isinstance(error, PermanentFailure) and str(KEY) in str(error)
    assert setup.hook.requests == []


def test_uri_not_allowed_fails_permanently() -> None:
    setup = Setup(allow=False)
    error = setup.run()
    assert isinstance(error, PermanentFailure) and "feed.http-hooks" in str(error)
    assert "s3cr3t" not in str(error)
    assert setup.hook.requests == []


def test_bad_task_data_fails_permanently() -> None:
    setup = Setup()
    assert isinstance(setup.run(task=make_task("x", key=None)), PermanentFailure)
    assert setup.phorge.requests == []


@pytest.mark.parametrize("status", [200, 201, 204])
def test_2xx_is_success(status: int) -> None:
    assert Setup(Reply(status)).run() is None


@pytest.mark.parametrize("status", [500, 502, 503, 429])
def test_5xx_and_429_are_retried_with_backoff(status: int) -> None:
    for failures in (0, 3, 100):
        error = Setup(Reply(status)).run(failure_count=failures)
        assert isinstance(error, TemporaryFailure) and f"HTTP {status}" in str(error)
        assert error.delay == retry_wait(failures + 1) == min((failures + 1) * 60, 3600)


def test_retry_after_is_honoured() -> None:
    error = Setup(Reply(429, headers={"Retry-After": "600"})).run()
    assert isinstance(error, TemporaryFailure) and error.delay == 600


@pytest.mark.parametrize("status", [400, 403, 404, 410])
def test_other_4xx_fail_permanently_after_a_few_attempts(status: int) -> None:
    first = Setup(Reply(status)).run(failure_count=0)
    assert isinstance(first, TemporaryFailure) and f"HTTP {status}" in str(first)
    assert isinstance(Setup(Reply(status)).run(failure_count=1), TemporaryFailure)
    last = Setup(Reply(status)).run(failure_count=2)
    assert isinstance(last, PermanentFailure) and "giving up" in str(last)


def test_redirects_are_not_followed() -> None:
    setup = Setup(Reply(302, headers={"Location": "http://127.0.0.1:9/elsewhere"}))
    error = setup.run()
    assert isinstance(error, TemporaryFailure) and "redirect" in str(error)
    assert len(setup.hook.requests) == 1


def test_slow_hook_times_out() -> None:
    error = Setup(Reply(200, delay=2)).run(timeout=0.3)
    assert isinstance(error, TemporaryFailure) and "timed out" in str(error)


def test_unreachable_hook_is_temporary() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = f"http://127.0.0.1:{port}/hook"
    phorge = FakeServer(
        lambda r: conduit_result({"silent": False, "hookURIs": [dead], "story": STORY})
    )
    with phorge:
        handler = FeedPublisherHTTPHandler(ConduitClient(phorge.url, TOKEN), timeout=2)
        with pytest.raises(TemporaryFailure) as info:
            handler.run(make_task(dead))
    assert info.value.delay == 60


def test_conduit_outages_yield_without_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    setup = Setup(conduit_reply=conduit_error("ERR-INVALID-AUTH", "API token is not valid."))
    error = setup.run()
    assert isinstance(error, Yield)
    assert setup.hook.requests == []
    assert any(r.levelno >= logging.ERROR for r in caplog.records)
    assert isinstance(Setup(conduit_reply=Reply(502, b"bad gateway")).run(), Yield)


def test_every_attempt_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bridge.transports.conduit.feed")
    setup = Setup(Reply(503))
    setup.run(failure_count=4)
    lines = [r.getMessage() for r in caplog.records if r.name == "bridge.transports.conduit.feed"]
    assert any(
        setup.hook.url + "/hook?[redacted]" in line and "HTTP 503" in line and "attempt 5" in line
        for line in lines
    ), lines
    assert "s3cr3t" not in caplog.text


def test_redact_uri() -> None:
    assert (
        redact_uri("https://user:pw@h.example:8443/p?t=1") == "https://h.example:8443/p?[redacted]"
    )
    assert redact_uri("http://h.example/p") == "http://h.example/p"

"""The Phorge install that the PHORGE_ROOT tests run against (shared by its test modules).

PHORGE_ROOT is a Phorge checkout, with arcanist beside it, whose database is set up
(``bin/storage upgrade``). Tests reach Phorge only through its own PHP: small helper
scripts that ``require_once`` Phorge's ``scripts/init/init-script.php``, Phorge's
command-line tools (``bin/worker``) and, for HTTP, a ``php -S`` server.

Phorge's command-line tools ignore SIGTERM, so every process started here is killed
with SIGKILL (its whole process group) when it overruns its timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self
from urllib.parse import parse_qs, urlsplit

import phorge_checkout
import pytest
import sqlalchemy as sa
from phorge_checkout import NotACheckout, check_checkout

PHORGE_ROOT = os.environ.get("PHORGE_ROOT")
# Making accounts through Phorge's classes: shared with the bench (scripts/).
ACCOUNTS_PHP = Path(phorge_checkout.__file__).with_name("phorge_accounts.php")
# Reading what Phorge's work left (feed stories, index, mail, the feed hook's body).
EFFECTS_PHP = Path(__file__).with_name("phorge_effects.php")

# How a helper script that makes accounts or reads effects starts: its arguments (the
# checkout, a command, one JSON document), Phorge loaded, the PHP that ``with_helper``
# puts beside it, and the omnipotent viewer.
HELPER_START = r"""<?php
$root = $argv[1];
$command = $argv[2];
$args = json_decode(isset($argv[3]) ? $argv[3] : '{}', true);
require_once $root.'/scripts/init/init-script.php';
require_once $argv[0].'.accounts.php';
require_once $argv[0].'.effects.php';
$viewer = PhabricatorUser::getOmnipotentUser();
"""

# What a web server's rewrite rule does for Phorge, for ``php -S``.
ROUTER = r"""<?php
$path = parse_url($_SERVER['REQUEST_URI'], PHP_URL_PATH);
$_GET['__path__'] = $path;
$_REQUEST['__path__'] = $path;
// Cluster mode insists on it; php -S does not set it.
if (!isset($_SERVER['SERVER_ADDR'])) {
  $_SERVER['SERVER_ADDR'] = '127.0.0.1';
}
require getenv('PHORGE_WEBROOT').'/index.php';
"""


def phorge_root() -> Path:
    """PHORGE_ROOT, checked to be a Phorge checkout with arcanist beside it."""
    try:
        return check_checkout(PHORGE_ROOT or "")
    except NotACheckout as exc:
        problem = str(exc)
    pytest.fail(problem)


def is_upstream_phabricator(root: Path) -> bool:
    """Whether the checkout is upstream Phabricator rather than Phorge, its fork: the
    few places the two behave differently are named where a test meets them. Phorge's
    library has classes of its own name; Phabricator's has none."""
    return "'Phorge" not in (root / "src" / "__phutil_library_map__.php").read_text()


def run(
    command: Sequence[str],
    *,
    timeout: float = 120,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command to completion; SIGKILL its process group if it overruns ``timeout``."""
    process = subprocess.Popen(
        list(command),
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(process)
        pytest.fail(f"{' '.join(command)} did not finish within {timeout}s; killed it")
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)


def kill(process: subprocess.Popen) -> None:
    """SIGKILL a process started with ``start_new_session`` and its children; reap it."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.communicate()


class Phorge:
    """The Phorge under test: its checkout, a helper script run inside it, its CLI tools."""

    def __init__(self, root: Path, helper: Path) -> None:
        self.root = root
        self.helper = helper
        self.url = ""

    @classmethod
    def with_helper(cls, root: Path, work: Path, source: str) -> Self:
        """An instance whose helper script (PHP ``source``) is written into ``work``, with
        ``scripts/phorge_accounts.php`` beside it as ``helper.php.accounts.php`` and
        ``tests/helpers/phorge_effects.php`` as ``helper.php.effects.php``."""
        helper = work / "helper.php"
        helper.write_text(source)
        shutil.copyfile(ACCOUNTS_PHP, f"{helper}.accounts.php")
        shutil.copyfile(EFFECTS_PHP, f"{helper}.effects.php")
        return cls(root, helper)

    def helper_command(self, *args: str) -> list[str]:
        """The command line that runs the helper script with ``args``."""
        return ["php", str(self.helper), str(self.root), *args]

    def php_text(self, *args: str, timeout: float = 120) -> str:
        """Run the helper script; return its standard output (fails on a non-zero exit)."""
        done = run(self.helper_command(*args), timeout=timeout)
        assert done.returncode == 0, f"helper {args[:1]} failed:\n{done.stdout}{done.stderr}"
        return done.stdout

    def php(self, *args: str, timeout: float = 120) -> Any:
        """Run the helper script; return its standard output decoded as JSON."""
        out = self.php_text(*args, timeout=timeout)
        return json.loads(out) if out.strip() else None

    def bin(self, tool: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run one of Phorge's ``bin/`` tools (``bin/worker retry --id 3``), whatever it exits."""
        return run(["php", str(self.root / "bin" / tool), *args], timeout=timeout)


def wait_for_port(host: str, port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            sock.settimeout(0.2)
            if sock.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    pytest.fail(f"php -S did not listen on {host}:{port}")


@contextmanager
def php_server(root: Path, url: str, work: Path) -> Iterator[None]:
    """Serve Phorge at ``url`` (which must be on this machine) with ``php -S``."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 80
    if host not in {"127.0.0.1", "localhost"}:
        pytest.fail(f"set PHORGE_URL: phabricator.base-uri {url} is not on this machine")
    router = work / "router.php"
    router.write_text(ROUTER)
    with (work / "php-server.log").open("wb") as log:
        server = subprocess.Popen(
            ["php", "-S", f"{host}:{port}", "-t", str(root / "webroot"), str(router)],
            env={**os.environ, "PHORGE_WEBROOT": str(root / "webroot")},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for_port(host, port)
        yield
    finally:
        kill(server)


class HookReceiver(ThreadingHTTPServer):
    """A feed hook endpoint (``feed.http-hooks``) on this machine: keeps every POST
    (path, headers, body), answers 200."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver.lock:
                    receiver.posts.append(
                        {"path": self.path, "headers": dict(self.headers), "body": body.decode()}
                    )
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    @property
    def objects(self) -> list[str]:
        """The ``storyData`` object PHID of every POST, in turn."""
        with self.lock:
            bodies = [post["body"] for post in self.posts]
        return [phid for body in bodies for phid in parse_qs(body).get("storyData[objectPHID]", [])]


@contextmanager
def hook_receiver() -> Iterator[HookReceiver]:
    """A :class:`HookReceiver`, serving in a thread for the block."""
    server = HookReceiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def worker_database_url(env: dict[str, str]) -> str:
    """The worker database Phorge's own configuration names (the helper's ``env``
    answer: user, pass, host, port, db), as a URL for the bridge."""
    return sa.URL.create(
        "mysql+mysqldb",
        username=env["user"],
        password=env["pass"],
        host=env["host"],
        port=int(env["port"]) if env["port"] else None,
        database=env["db"],
    ).render_as_string(hide_password=False)

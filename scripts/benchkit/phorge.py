"""A real Phorge, with ``PHORGE_ROOT``: phd, the PHP section's classes and its web tier.

The checkout is never touched: it is copied (no ``.git``), arcanist beside it, into the
bench's scratch directory, with a ``conf/local/local.json`` naming the bench's MariaDB;
``bin/storage upgrade --force`` makes Phorge's databases (with the commit flush relaxed
to 2 for that step only), then the bench recreates the four queue tables from the same DDL.

The PHP section (:func:`prepare`) adds two classes only PHP runs: the bench's no-op
``PhorgeBridgeBenchNoopWorker``, copied into the copy's ``src/extensions/`` (Phorge's
loader includes it; ``php/helper.php`` checks), and ``PhabricatorSearchWorker``
re-indexing real users, several, taken in turn: the worker holds a lock per document,
so tasks of one document would wait for each other whatever the consumer. The Conduit
path needs the bridge's extension (``phorge-bridge phorge install-extension``) and an
administrator bot's API token (``helper.php`` makes both), and a web tier: ``php -S``
with opcache on (checked through ``php/router.php``'s ``/__bench/opcache``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import MySQLdb
import phorge_checkout
import requests

from benchkit import procs
from benchkit.mariadb import PASSWORD, USER, Server
from benchkit.procs import BenchError

REPO = Path(__file__).resolve().parents[2]
PHP_DIR = Path(__file__).resolve().parent / "php"
NOOP_CLASS, SEARCH_CLASS = "PhorgeBridgeBenchNoopWorker", "PhabricatorSearchWorker"
DOCUMENTS = 16  # users to re-index: more than any consumer runs at once
WEB_PORT, WEB_WORKERS = 8799, 4
OPCACHE = ("-d", "opcache.enable=1", "-d", "opcache.enable_cli=1")  # cli-server counts as CLI


@dataclass
class Install:
    root: Path  # the copy's phorge directory
    env: dict[str, str]
    web_port: int
    notes: list[str] = field(default_factory=list)
    token: str = ""  # the PHP section's: the bot's Conduit API token
    documents: list[str] = field(default_factory=list)  # PHIDs the search tasks re-index


def run(command: list[str], what: str, **kwargs: Any) -> str:
    done = subprocess.run(command, capture_output=True, text=True, start_new_session=True, **kwargs)
    if done.returncode:
        raise BenchError(f"{what} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout


@contextmanager
def install(
    checkout: Path,
    server: Server,
    conn: MySQLdb.Connection,
    scratch: Path,
    log: Callable[[str], None],
    web_port: int,
) -> Iterator[Install]:
    """A configured, upgraded copy of the checkout, in ``scratch`` (gone with it)."""
    try:
        phorge_checkout.check_checkout(
            checkout, php_modules=("mysqli", "curl", "mbstring", "pcntl")
        )
    except phorge_checkout.NotACheckout as exc:
        raise BenchError(str(exc)) from None
    log(f"copying {checkout} and its arcanist into the bench's temporary directory")
    for name, source in (("phorge", checkout), ("arcanist", checkout.parent / "arcanist")):
        shutil.copytree(
            source,
            scratch / "phorge-copy" / name,
            symlinks=True,
            ignore=shutil.ignore_patterns(".git"),
        )
    root = scratch / "phorge-copy" / "phorge"
    config = {
        "mysql.host": "127.0.0.1",
        "mysql.port": str(server.port),
        "mysql.user": USER,
        "mysql.pass": PASSWORD,
        "storage.default-namespace": "phabricator",
        "phd.log-directory": str(scratch / "phd-log"),
        "phabricator.base-uri": f"http://127.0.0.1:{web_port}/",  # Phorge answers only its own host
    }
    (root / "conf" / "local").mkdir(parents=True, exist_ok=True)
    (root / "conf" / "local" / "local.json").write_text(json.dumps(config, indent=2))
    (scratch / "phd-log").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PHABRICATOR_ENV", "PHORGE_ROOT")}
    log("bin/storage upgrade --force on the bench's MariaDB (a few minutes)")
    conn.cursor().execute("SET GLOBAL innodb_flush_log_at_trx_commit = 2")
    try:
        run(
            ["php", str(root / "bin" / "storage"), "upgrade", "--force"],
            "bin/storage upgrade",
            env=env,
            cwd=root,
            timeout=1800,
        )
    finally:
        conn.cursor().execute("SET GLOBAL innodb_flush_log_at_trx_commit = 1")
    revision = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    note = (
        f"phd: Phorge {revision or '(no git)'} from {checkout}, run from a copy configured for the "
        "bench's MariaDB as `bin/phd debug taskmaster` (one per process); its overseer logs to "
        "`daemon_logevent` (statements `phd start` would not make)."
    )
    yield Install(root, env, web_port, [note])


@contextmanager
def prepare(setup: Install, log: Callable[[str], None]) -> Iterator[Install]:
    """The PHP section's no-op class (removed afterwards), the extension, the bot, the users."""
    target = setup.root / "src" / "extensions" / f"{NOOP_CLASS}.php"
    shutil.copyfile(PHP_DIR / target.name, target)
    try:
        log(f"installing {NOOP_CLASS}, the bridge's extension, a bot and {DOCUMENTS} users")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        command = [
            sys.executable,
            "-m",
            "bridge.cli",
            "phorge",
            "install-extension",
            "--phorge-root",
            str(setup.root),
        ]
        run(command, "install-extension", cwd=REPO, env=env, timeout=120)
        out = run(
            ["php", str(PHP_DIR / "helper.php"), str(setup.root), "setup", str(DOCUMENTS)],
            "helper.php",
            cwd=setup.root,
            env=setup.env,
            timeout=300,
        )
        answer = json.loads(out.strip().splitlines()[-1])
        if not answer.get("noopLoaded") or not answer.get("admin"):
            raise BenchError(
                f"helper.php: the no-op class not found or the bot not an administrator: {answer}"
            )
        setup.token, setup.documents = str(answer["token"]), [str(d) for d in answer["documents"]]
        setup.notes.append(
            f"PHP section: PHP {answer.get('php')}; `{NOOP_CLASS}` (a `doWork()` that returns) in "
            f"the copy's `src/extensions/`; `{SEARCH_CLASS}` re-indexes {DOCUMENTS} users in turn "
            "with `parameters.force` (as `bin/search index --force`); the Conduit token an "
            "administrator bot's."
        )
        yield setup
    finally:
        target.unlink(missing_ok=True)


def search_data(documents: list[str]) -> tuple[str, ...]:
    """What ``queueDocumentForIndexing`` writes, with ``force``: without it a current
    document is only looked up, not indexed."""
    return tuple(json.dumps({"documentPHID": d, "parameters": {"force": True}}) for d in documents)


@dataclass
class WebTier:
    url: str
    proc: procs.Proc

    def opcache(self) -> dict[str, Any]:
        """One web worker's ``enabled``, ``scripts``, ``hits``, ``misses``, ``sapi``."""
        answer = requests.get(f"{self.url}/__bench/opcache", timeout=10)
        answer.raise_for_status()
        status: dict[str, Any] = answer.json()
        return status

    def accepted(self) -> int:
        """Connections ``php -S`` accepted (it logs each): the bridge's requests."""
        try:
            return self.proc.log.read_bytes().count(b" Accepted\n")
        except OSError:
            return 0


def web_tier(root: Path, port: int, directory: Path) -> WebTier:
    """``PHP_CLI_SERVER_WORKERS=4 php -d opcache... -S`` with Phorge's rewrite rule as
    router; returns once it answers with opcache on (else stops it and raises)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PHABRICATOR_ENV", "PHORGE_ROOT")}
    env.update(PHP_CLI_SERVER_WORKERS=str(WEB_WORKERS), PHORGE_WEBROOT=str(root / "webroot"))
    command = [
        "php",
        *OPCACHE,
        "-S",
        f"127.0.0.1:{port}",
        "-t",
        str(root / "webroot"),
        str(PHP_DIR / "router.php"),
    ]
    web = WebTier(
        f"http://127.0.0.1:{port}",
        procs.start("php -S", command, env=env, cwd=root, log=directory / "php-server.log"),
    )
    status: dict[str, Any] = {}

    def answers() -> bool:
        if not web.proc.alive():
            raise BenchError(f"php -S exited:\n{web.proc.tail()}")
        try:
            status.update(web.opcache())
        except (requests.RequestException, ValueError):
            return False
        return True

    try:
        procs.wait_until(answers, timeout=30, what=f"php -S on port {port}", interval=0.1)
        if not status.get("enabled"):
            raise BenchError(f"opcache is off in the web tier ({status})")
    except BaseException:
        procs.stop(web.proc)
        raise
    return web

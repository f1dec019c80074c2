"""A real Phorge, with ``PHORGE_ROOT``: phd, the PHP section's classes and its web tier.

The checkout is never touched: a copy (no ``.git``, arcanist beside it) in the scratch
directory is configured for the bench's MariaDB and upgraded. :func:`prepare` adds the
bench's no-op class, the bridge's extension, an administrator bot (Conduit token) and
several users to re-index in turn (the search worker locks a document).
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
PHP_MODULES = ("mysqli", "curl", "mbstring", "pcntl")
Log = Callable[[str], None]


@dataclass
class Install:
    root: Path  # the copy's phorge directory
    env: dict[str, str]
    web_port: int
    notes: list[str] = field(default_factory=list)
    token: str = ""  # the PHP section's: the bot's Conduit API token
    documents: list[str] = field(default_factory=list)  # PHIDs the search tasks re-index


def php_env(**extra: str) -> dict[str, str]:
    """Ours, without what would point Phorge at another configuration."""
    env = {k: v for k, v in os.environ.items() if k not in ("PHABRICATOR_ENV", "PHORGE_ROOT")}
    return env | extra


def run(command: list[str], what: str, **kwargs: Any) -> str:
    done = subprocess.run(command, capture_output=True, text=True, start_new_session=True, **kwargs)
    if done.returncode:
        raise BenchError(f"{what} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout


@contextmanager
def install(
    checkout: Path, server: Server, conn: MySQLdb.Connection, scratch: Path, log: Log, port: int
) -> Iterator[Install]:
    """A configured, upgraded copy of the checkout, in ``scratch`` (gone with it)."""
    try:
        phorge_checkout.check_checkout(checkout, php_modules=PHP_MODULES)
    except phorge_checkout.NotACheckout as exc:
        raise BenchError(str(exc)) from None
    log(f"copying {checkout} and its arcanist into the bench's temporary directory")
    for name, source in (("phorge", checkout), ("arcanist", checkout.parent / "arcanist")):
        target, ignore = scratch / "phorge-copy" / name, shutil.ignore_patterns(".git")
        shutil.copytree(source, target, symlinks=True, ignore=ignore)
    root = scratch / "phorge-copy" / "phorge"
    # phabricator.base-uri: Phorge answers only its own host.
    config = {"mysql.host": "127.0.0.1", "mysql.port": str(server.port), "mysql.user": USER,
              "mysql.pass": PASSWORD, "storage.default-namespace": "phabricator",
              "phd.log-directory": str(scratch / "phd-log"),
              "phabricator.base-uri": f"http://127.0.0.1:{port}/"}  # fmt: skip
    (root / "conf" / "local").mkdir(parents=True, exist_ok=True)
    (root / "conf" / "local" / "local.json").write_text(json.dumps(config, indent=2))
    (scratch / "phd-log").mkdir(exist_ok=True)
    env = php_env()
    log("bin/storage upgrade --force on the bench's MariaDB (a few minutes)")
    conn.cursor().execute("SET GLOBAL innodb_flush_log_at_trx_commit = 2")  # for this step only
    try:
        storage = ["php", str(root / "bin" / "storage"), "upgrade", "--force"]
        run(storage, "bin/storage upgrade", env=env, cwd=root, timeout=1800)
    finally:
        conn.cursor().execute("SET GLOBAL innodb_flush_log_at_trx_commit = 1")
    git = ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"]
    revision = subprocess.run(git, capture_output=True, text=True).stdout.strip()
    note = (
        f"phd: Phorge {revision or '(no git)'} from {checkout}, run from a copy configured for the "
        "bench's MariaDB as `bin/phd debug taskmaster` (one per process); its overseer logs to "
        "`daemon_logevent` (statements `phd start` would not make)."
    )
    yield Install(root, env, port, [note])


@contextmanager
def prepare(setup: Install, log: Log) -> Iterator[Install]:
    """The PHP section's no-op class (removed afterwards), the extension, the bot, the users."""
    target = setup.root / "src" / "extensions" / f"{NOOP_CLASS}.php"
    shutil.copyfile(PHP_DIR / target.name, target)
    try:
        log(f"installing {NOOP_CLASS}, the bridge's extension, a bot and {DOCUMENTS} users")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        command = f"-m bridge.cli phorge install-extension --phorge-root {setup.root}".split()
        run([sys.executable, *command], "install-extension", cwd=REPO, env=env, timeout=120)
        helper = ["php", str(PHP_DIR / "helper.php"), str(setup.root), str(DOCUMENTS)]
        out = run(helper, "helper.php", cwd=setup.root, env=setup.env, timeout=300)
        answer = json.loads(out.strip().splitlines()[-1])
        if not answer.get("noopLoaded") or not answer.get("admin"):
            wrong = "the no-op class not found or the bot not an administrator"
            raise BenchError(f"helper.php: {wrong}: {answer}")
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
        """One web worker's opcache ``enabled``, ``hits`` and ``misses``."""
        answer = requests.get(f"{self.url}/__bench/opcache", timeout=10)
        answer.raise_for_status()
        return dict(answer.json())

    def accepted(self) -> int:
        """Connections ``php -S`` accepted (it logs each): the bridge's requests."""
        try:
            return self.proc.log.read_bytes().count(b" Accepted\n")
        except OSError:
            return 0


def web_tier(root: Path, port: int, directory: Path) -> WebTier:
    """``PHP_CLI_SERVER_WORKERS=4 php -d opcache... -S`` with Phorge's rewrite rule as
    router; returns once it answers with opcache on (else stops it and raises)."""
    webroot = str(root / "webroot")
    env = php_env(PHP_CLI_SERVER_WORKERS=str(WEB_WORKERS), PHORGE_WEBROOT=webroot)
    router, log = str(PHP_DIR / "router.php"), directory / "php-server.log"
    command = ["php", *OPCACHE, "-S", f"127.0.0.1:{port}", "-t", webroot, router]
    proc = procs.start("php -S", command, env=env, cwd=root, log=log)
    web = WebTier(f"http://127.0.0.1:{port}", proc)
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

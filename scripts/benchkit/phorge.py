"""A real Phorge, with ``PHORGE_ROOT``: phd, the PHP section's classes and its web tier.

The checkout is never touched: a copy (no ``.git``, arcanist beside it) in the scratch
directory, gone with it, is configured for the bench's MariaDB and upgraded, with the
bench's no-op class, the bridge's extension, an administrator bot (Conduit token) and
several users to re-index in turn (the search worker locks a document).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
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


@dataclass
class Install:
    root: Path  # the copy's phorge directory
    env: dict[str, str]
    token: str  # the bot's Conduit API token
    documents: list[str]  # PHIDs the search tasks re-index
    notes: list[str] = field(default_factory=list)


def php_env(**extra: str) -> dict[str, str]:
    """Ours, without what would point Phorge at another configuration."""
    env = {k: v for k, v in os.environ.items() if k not in ("PHABRICATOR_ENV", "PHORGE_ROOT")}
    return env | extra


def run(command: list[str], what: str, **kwargs: Any) -> str:
    done = subprocess.run(command, capture_output=True, text=True, start_new_session=True, **kwargs)
    if done.returncode:
        raise BenchError(f"{what} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout


def install(
    checkout: Path, server: Server, conn: MySQLdb.Connection, scratch: Path,
    log: Callable[[str], None],
) -> Install:  # fmt: skip
    """A configured, upgraded copy of the checkout in ``scratch``, with the PHP section's
    no-op class, the bridge's extension, the bot and the users."""
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
              "phabricator.base-uri": f"http://127.0.0.1:{WEB_PORT}/"}  # fmt: skip
    (root / "conf" / "local").mkdir(parents=True, exist_ok=True)
    (root / "conf" / "local" / "local.json").write_text(json.dumps(config, indent=2))
    (scratch / "phd-log").mkdir(exist_ok=True)
    noop = f"{NOOP_CLASS}.php"
    shutil.copyfile(PHP_DIR / noop, root / "src" / "extensions" / noop)
    env = php_env()
    log("bin/storage upgrade --force on the bench's MariaDB (a few minutes)")
    conn.cursor().execute("SET GLOBAL innodb_flush_log_at_trx_commit = 2")  # for this step only
    try:
        storage = ["php", str(root / "bin" / "storage"), "upgrade", "--force"]
        run(storage, "bin/storage upgrade", env=env, cwd=root, timeout=1800)
    finally:
        conn.cursor().execute("SET GLOBAL innodb_flush_log_at_trx_commit = 1")
    log(f"installing the bridge's extension, a bot and {DOCUMENTS} users")
    command = f"-m bridge.cli phorge install-extension --phorge-root {root}".split()
    extension_env = {**os.environ, "PYTHONPATH": str(REPO)}
    run([sys.executable, *command], "install-extension", cwd=REPO, env=extension_env, timeout=120)
    helper = ["php", str(PHP_DIR / "helper.php"), str(root), str(DOCUMENTS)]
    answer = json.loads(run(helper, "helper.php", cwd=root, env=env, timeout=300).splitlines()[-1])
    if not answer.get("noopLoaded") or not answer.get("admin"):
        raise BenchError(f"helper.php: the no-op class not found or the bot no admin: {answer}")
    git = ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"]
    revision = subprocess.run(git, capture_output=True, text=True).stdout.strip() or "(no git)"
    notes = [
        f"phd: Phorge {revision} from {checkout} on PHP {answer.get('php')}, run from a copy "
        "configured for the bench's MariaDB as `bin/phd debug taskmaster` (one per process); "
        "its overseer logs to `daemon_logevent` (statements `phd start` would not make).",
        f"PHP section: `{NOOP_CLASS}` (a `doWork()` that returns) in the copy's "
        f"`src/extensions/`; `{SEARCH_CLASS}` re-indexes {DOCUMENTS} users in turn with "
        "`parameters.force` (as `bin/search index --force`); the Conduit token an "
        "administrator bot's.",
    ]
    return Install(root, env, str(answer["token"]), [str(d) for d in answer["documents"]], notes)


def search_data(documents: list[str]) -> tuple[str, ...]:
    """What ``queueDocumentForIndexing`` writes, with ``force``: without it a current
    document is only looked up, not indexed."""
    return tuple(json.dumps({"documentPHID": d, "parameters": {"force": True}}) for d in documents)


@dataclass
class WebTier:
    url: str
    proc: procs.Proc

    def accepted(self) -> int:
        """Connections ``php -S`` accepted (it logs each): the bridge's requests."""
        try:
            return self.proc.log.read_bytes().count(b" Accepted\n")
        except OSError:
            return 0


def web_tier(root: Path, directory: Path) -> WebTier:
    """``PHP_CLI_SERVER_WORKERS=4 php -d opcache... -S`` with Phorge's rewrite rule as
    router; returns once it answers with opcache on (else stops it and raises)."""
    webroot, url = str(root / "webroot"), f"http://127.0.0.1:{WEB_PORT}"
    env = php_env(PHP_CLI_SERVER_WORKERS=str(WEB_WORKERS), PHORGE_WEBROOT=webroot)
    command = ["php", *OPCACHE, "-S", url[7:], "-t", webroot, str(PHP_DIR / "router.php")]
    proc = procs.start("php -S", command, env=env, cwd=root, log=directory / "php-server.log")
    status: dict[str, Any] = {}

    def answers() -> bool:
        if not proc.alive():
            raise BenchError(f"php -S exited:\n{proc.tail()}")
        try:
            status.update(requests.get(f"{url}/__bench/opcache", timeout=10).json())
        except (requests.RequestException, ValueError):
            return False
        return True

    try:
        procs.wait_until(answers, timeout=30, what=f"php -S on {url}", interval=0.1)
        if not status.get("enabled"):
            raise BenchError(f"opcache is off in the web tier ({status})")
    except BaseException:
        procs.stop(proc)
        raise
    return WebTier(url, proc)

"""A real Phorge for ``bin/phd debug taskmaster``, pointed at the bench's MariaDB.

Only when ``PHORGE_ROOT`` (or ``--phorge-root``) names a Phorge checkout with arcanist
beside it. The checkout is never touched: it is copied (without ``.git``) into the
bench's temporary directory, and the copy gets its own ``conf/local/local.json`` (the
checkout's own local config would otherwise override anything passed through
``PHABRICATOR_ENV``). ``bin/storage upgrade --force`` then creates Phorge's databases on
the bench's server, after which the bench recreates the four queue tables from the
reference DDL (the same DDL). Schema creation is thousands of DDL statements, so the
server's commit flush is relaxed to 2 for that step only and set back to 1 before any
measurement.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import MySQLdb
import phorge_checkout

from benchkit.mariadb import PASSWORD, USER, Server
from benchkit.procs import BenchError

UPGRADE_TIMEOUT = 1800
PHP_MODULES = ("mysqli", "curl", "mbstring", "pcntl")  # what phd needs of PHP


WEB_PORT = 8799  # the port of the copy's phabricator.base-uri (the PHP section's web tier)


@dataclass
class Install:
    root: Path  # the copy's phorge directory
    env: dict[str, str]
    notes: list[str] = field(default_factory=list)
    web_port: int = WEB_PORT  # phabricator.base-uri is http://127.0.0.1:<web_port>/


def check_checkout(root: Path) -> None:
    """Refuse early, with the reason, when phd cannot run from ``root``."""
    try:
        phorge_checkout.check_checkout(root, php_modules=PHP_MODULES)
    except phorge_checkout.NotACheckout as exc:
        raise BenchError(str(exc)) from None


def local_config(server: Server, scratch: Path, web_port: int = WEB_PORT) -> dict[str, str]:
    """What the copy's ``conf/local/local.json`` says: our server, logs in scratch, and
    the base URI the PHP section's web tier serves (Phorge answers only its own host)."""
    return {
        "mysql.host": "127.0.0.1",
        "mysql.port": str(server.port),
        "mysql.user": USER,
        "mysql.pass": PASSWORD,
        "storage.default-namespace": "phabricator",
        "phd.log-directory": str(scratch / "phd-log"),
        "phabricator.base-uri": f"http://127.0.0.1:{web_port}/",
    }


def copy_checkout(checkout: Path, target: Path) -> Path:
    """Copy phorge and arcanist side by side under ``target``; returns the phorge copy."""
    ignore = shutil.ignore_patterns(".git")
    for name, source in (("phorge", checkout), ("arcanist", checkout.parent / "arcanist")):
        shutil.copytree(source, target / name, symlinks=True, ignore=ignore)
    return target / "phorge"


def storage_upgrade(root: Path, env: dict[str, str], conn: MySQLdb.Connection) -> None:
    cur = conn.cursor()
    cur.execute("SET GLOBAL innodb_flush_log_at_trx_commit = 2")
    try:
        done = subprocess.run(
            ["php", str(root / "bin" / "storage"), "upgrade", "--force"],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=UPGRADE_TIMEOUT,
            start_new_session=True,
        )
    finally:
        cur.execute("SET GLOBAL innodb_flush_log_at_trx_commit = 1")
    if done.returncode:
        raise BenchError(f"bin/storage upgrade failed:\n{(done.stdout + done.stderr)[-3000:]}")


@contextmanager
def install(
    checkout: Path,
    server: Server,
    conn: MySQLdb.Connection,
    scratch: Path,
    log: Callable[[str], None],
    web_port: int = WEB_PORT,
) -> Iterator[Install]:
    """A configured, upgraded copy of the checkout; it lives (and dies) in ``scratch``."""
    check_checkout(checkout)
    log(f"copying {checkout} and its arcanist into the bench's temporary directory")
    root = copy_checkout(checkout, scratch / "phorge-copy")
    config = root / "conf" / "local" / "local.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(local_config(server, scratch, web_port), indent=2))
    (scratch / "phd-log").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PHABRICATOR_ENV"}
    log("bin/storage upgrade --force on the bench's MariaDB (a few minutes)")
    storage_upgrade(root, env, conn)
    revision = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    notes = [
        f"phd: Phorge {revision or '(no git)'} from {checkout}, run from a copy configured for "
        "the bench's MariaDB, as `bin/phd debug taskmaster` (one per process). Debug mode "
        "runs the daemon with --verbose, and its overseer writes those log lines to "
        "`phabricator_daemon.daemon_logevent`: server-side statements and commits that "
        "`phd start` would not make (phd's Questions minus the taskmaster's 7 per task).",
    ]
    yield Install(root, env, notes, web_port)

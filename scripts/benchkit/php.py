"""The PHP section's Phorge: classes only PHP can run, in the bench's scratch copy.

The bridge runs ``PhabricatorTestWorker`` natively, so it cannot show what running a
PHP-only class costs. This section uses two that only PHP has, on the same copy the phd
scenarios run (``phorge.install``):

- ``PhorgeBridgeBenchNoopWorker`` (``php/PhorgeBridgeBenchNoopWorker.php``), a no-op,
  so the figure is the cost of the path to PHP and back. It is copied into the copy's
  ``src/extensions/``, which Phorge's library loader includes by itself (no library map
  to rebuild: ``helper.php`` checks that Phorge finds it), and deleted when the section
  ends; the copy itself dies with the bench's scratch directory.
- ``PhabricatorSearchWorker`` re-indexing a real document: users made through Phorge's
  own classes. Several, because the worker holds a per-document lock
  (``PhabricatorGlobalLock`` ``index``, 1 s wait, then a 15 s yield): consumers running
  tasks of ONE document at once would queue on that lock, or yield, whatever their speed.
  Tasks take the documents in turn, so tasks that run at the same time index different
  ones.

The Conduit path also needs the bridge's extension in the copy (``phorge-bridge phorge
install-extension``, run as the CLI) and an administrator bot's API token (``helper.php``
makes both the bot and the token).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchkit.consumers import REPO
from benchkit.phorge import Install
from benchkit.procs import BenchError
from benchkit.runner import Workload

PHP_DIR = Path(__file__).resolve().parent / "php"
NOOP_CLASS = "PhorgeBridgeBenchNoopWorker"
SEARCH_CLASS = "PhabricatorSearchWorker"
NOOP_SOURCE = PHP_DIR / f"{NOOP_CLASS}.php"
HELPER = PHP_DIR / "helper.php"
DOCUMENTS = 16  # users to re-index, more than any consumer runs at once (8 threads)
HELPER_TIMEOUT = 300

PHP_NOOP = Workload("noop", "no-op PHP class", {}, task_class=NOOP_CLASS)
# The data PhabricatorSearchWorker::queueDocumentForIndexing() writes, less "strict",
# with the parameter ``bin/search index --force`` passes: without it, a document whose
# index is current is only looked up (its index versions match) and nothing is indexed,
# 1 ms of PHP instead of the 3 ms a user's indexing takes here. The document is filled
# in once the users exist (``PhpSetup.resolve``).
SEARCH_PARAMETERS = {"force": True}
PHP_SEARCH = Workload(
    "search",
    "PhabricatorSearchWorker on a user",
    {"documentPHID": "PHID-USER-...", "parameters": SEARCH_PARAMETERS},
    task_class=SEARCH_CLASS,
)

# The ping scenario's drain: no-op tasks through Conduit while the bench sends conduit.ping.
PHP_PING = replace(PHP_NOOP, key="ping", label="no-op PHP class, pinged", measure="ping")


@dataclass
class PhpSetup:
    """What the section's consumers need of the copy."""

    root: Path  # the copy's phorge directory
    env: dict[str, str]  # to run its PHP (phd, the runner)
    web_port: int  # phabricator.base-uri's port: the web tier must serve there
    token: str  # the administrator bot's Conduit API token
    documents: list[str]  # PHIDs the search tasks re-index
    notes: list[str] = field(default_factory=list)

    def resolve(self, workload: Workload) -> Workload:
        """The workload with its documents filled in (search), else unchanged."""
        if workload.task_class != SEARCH_CLASS:
            return workload
        variants = tuple(
            json.dumps(
                {"documentPHID": phid, "parameters": SEARCH_PARAMETERS}, separators=(",", ":")
            )
            for phid in self.documents
        )
        return replace(workload, variants=variants)


def install_extension(root: Path) -> str:
    """``phorge-bridge phorge install-extension`` into the copy, with this checkout's bridge."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "bridge.cli", "phorge", "install-extension"]
    done = subprocess.run(
        [*command, "--phorge-root", str(root)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if done.returncode:
        raise BenchError(f"install-extension failed:\n{(done.stdout + done.stderr)[-2000:]}")
    return done.stdout.strip()


def run_helper(root: Path, env: dict[str, str], *args: str) -> dict[str, object]:
    """``helper.php`` inside the copy; its JSON answer."""
    done = subprocess.run(
        ["php", str(HELPER), str(root), *args],
        cwd=root, env=env, capture_output=True, text=True, timeout=HELPER_TIMEOUT,
        start_new_session=True,
    )  # fmt: skip
    if done.returncode:
        raise BenchError(f"helper.php {args[0]} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    try:
        answer: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise BenchError(f"helper.php {args[0]} printed no JSON:\n{done.stdout[-2000:]}") from None
    return answer


@contextmanager
def prepare(install: Install, log: Callable[[str], None]) -> Iterator[PhpSetup]:
    """The no-op class (removed afterwards), the extension, the bot and the documents."""
    root = install.root
    target = root / "src" / "extensions" / NOOP_SOURCE.name
    log(f"installing {NOOP_CLASS} into the copy's src/extensions/ and the bridge's extension")
    shutil.copyfile(NOOP_SOURCE, target)
    try:
        installed = install_extension(root)
        log(f"making the bench's administrator bot, its API token and {DOCUMENTS} users")
        answer = run_helper(root, install.env, "setup", str(DOCUMENTS))
        documents = [str(phid) for phid in answer["documents"]]  # type: ignore[attr-defined]
        if not answer.get("noopLoaded"):
            raise BenchError(f"Phorge does not find {NOOP_CLASS} in src/extensions/")
        if not answer.get("admin"):
            raise BenchError("the bench's bot is not an administrator")
        notes = [
            f"PHP section: `{NOOP_CLASS}` (a `doWork()` that returns) copied into the scratch "
            "copy's `src/extensions/` by the bench and deleted at its end (the copy is "
            "deleted with the bench's scratch directory too); Phorge's loader found it "
            "(`class_exists`), and each consumer's warm-up batch ran it before any "
            "measurement.",
            f"PHP section: `{SEARCH_CLASS}` tasks re-index {len(documents)} users made "
            "through Phorge's own classes (the bot and "
            f"{len(documents) - 1} more), in turn: the worker holds a lock per document, "
            "so tasks of one document would wait for each other whatever the consumer. With "
            "`parameters.force` (as `bin/search index --force`): every task reads the user and "
            "rebuilds its fulltext and ngram rows, which come out as they were (the users do "
            "not change), so MariaDB writes little.",
            f"PHP section: PHP {answer.get('php')}; the bridge's extension installed in the "
            f"copy ({installed}); the Conduit token is an administrator bot's "
            "(`bridgebenchbot`).",
        ]
        yield PhpSetup(root, install.env, install.web_port, str(answer["token"]), documents, notes)
    finally:
        target.unlink(missing_ok=True)

"""Install and check the PHP extension (``worker.execute``, ``worker.feedstory``) in Phorge.

Phorge includes every ``.php`` file of ``src/extensions/`` at startup (and adds their
classes to its class map, so ``bin/phd`` and ``bin/config`` find them), so installing is
a copy of the extension's files: the Conduit methods and the task run they share with the
PHP runner; the canary's taskmaster daemon (``PhorgeBridgeQueueDaemon``),
its config options and the canary weights they share (``bridge/canary/php/``). "Current"
means the installed bytes equal the ones shipped in this package; one digest stands for
them all (``worker.version`` computes the same in PHP).
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from bridge.errors import BridgeError, PhorgeRootError

EXTENSION_FILENAME = "PhorgeBridgeConduitAPIMethods.php"
TASK_RUN_FILENAME = "PhorgeBridgeTaskRun.php"
DAEMON_FILENAME = "PhorgeBridgeQueueDaemon.php"
CONFIG_OPTIONS_FILENAME = "PhorgeBridgeCanaryConfigOptions.php"
CANARY_FILENAME = "PhorgeBridgeCanary.php"
# In the order of the digest (``getExtensionHash()`` lists them alike). Installed in the
# reverse order: the shared files (the canary weights, the task run) first, so a Phorge
# process starting during an install never includes a file without the one it requires.
EXTENSION_FILES = (
    EXTENSION_FILENAME,
    DAEMON_FILENAME,
    CONFIG_OPTIONS_FILENAME,
    TASK_RUN_FILENAME,
    CANARY_FILENAME,
)
RUNNER_FILENAME = "phorge-bridge-runner.php"
EXTENSIONS_DIR = Path("src") / "extensions"
VERSION_METHOD = "worker.version"


class ExtensionState(enum.Enum):
    CURRENT = "current"
    MISSING = "missing"
    OUTDATED = "outdated"


@dataclass(frozen=True)
class ExtensionStatus:
    """Whether the installed copy is the one this package ships; truthy only when current."""

    state: ExtensionState
    path: Path
    shipped_sha256: str
    installed_sha256: str | None = None

    def __bool__(self) -> bool:
        return self.state is ExtensionState.CURRENT

    def describe(self) -> str:
        if self.state is ExtensionState.CURRENT:
            return f"{self.path}: current"
        if self.state is ExtensionState.MISSING:
            return f"{self.path}: not installed"
        return (
            f"{self.path}: outdated (installed sha256 {self.installed_sha256}, "
            f"shipped {self.shipped_sha256}); run install-extension again"
        )


def shipped_file(name: str) -> Path:
    """Where a PHP file shipped in this package lies (package data, on disk): beside the
    Python it serves (a transport's, the canary's in ``canary/php/``), the task run both
    transports share in ``transports/``; each name is the package's once."""
    package = Path(str(resources.files("bridge")))
    found = sorted(package.rglob(name))
    if len(found) != 1:
        raise FileNotFoundError(f"{name}: {len(found)} copies shipped in {package}, not one")
    return found[0]


def shipped_source(name: str = EXTENSION_FILENAME) -> bytes:
    """A PHP file's source as shipped in this package (package data)."""
    return shipped_file(name).read_bytes()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def extension_sha256(sources: list[bytes]) -> str:
    """The digest of the extension's files: sha256 of their sha256 digests, in order."""
    return _sha256("".join(_sha256(source) for source in sources).encode())


def shipped_sha256() -> str:
    """What ``worker.version`` answers when the installed copies are the shipped ones."""
    return extension_sha256([shipped_source(name) for name in EXTENSION_FILES])


def shipped_version() -> str:
    """The release in the shipped file's ``const VERSION`` (one source for PHP and Python)."""
    found = re.search(rb"const VERSION = '([^']+)';", shipped_source())
    if found is None:
        raise BridgeError(f"{EXTENSION_FILENAME} declares no VERSION")
    return found.group(1).decode()


def validate_phorge_root(phorge_root: Path) -> Path:
    """Return the resolved root, or raise PhorgeRootError saying what is missing."""
    root = Path(phorge_root).expanduser()
    if not root.is_dir():
        raise PhorgeRootError(f"{root}: not a directory")
    root = root.resolve()
    expected = [
        root / "bin",
        root / "src",
        root / "src" / "__phutil_library_map__.php",
        root / "src" / "infrastructure" / "daemon" / "workers" / "PhabricatorWorker.php",
    ]
    missing = [str(p.relative_to(root)) for p in expected if not p.exists()]
    if missing:
        raise PhorgeRootError(
            f"{root} does not look like a Phorge checkout (missing: {', '.join(missing)})"
        )
    return root


def installed_path(phorge_root: Path) -> Path:
    return Path(phorge_root) / EXTENSIONS_DIR / EXTENSION_FILENAME


def install(phorge_root: Path) -> Path:
    """Copy the extension into ``<phorge_root>/src/extensions/``; return the methods' path.

    Each file is written next to its destination and renamed over it, so a Phorge process
    starting meanwhile includes either the old file or the new one, never half of one.
    """
    root = validate_phorge_root(phorge_root)
    target_dir = root / EXTENSIONS_DIR
    target_dir.mkdir(parents=True, exist_ok=True)
    for name in reversed(EXTENSION_FILES):
        _write(target_dir / name, shipped_source(name))
    return target_dir / EXTENSION_FILENAME


def _write(target: Path, source: bytes) -> None:
    target_dir = target.parent
    fd, tmp_name = tempfile.mkstemp(prefix=".phorge-bridge-", suffix=".tmp", dir=target_dir)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(source)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def check(phorge_root: Path) -> ExtensionStatus:
    """Report whether ``phorge_root`` has the current extension installed."""
    root = validate_phorge_root(phorge_root)
    target = installed_path(root)
    shipped = shipped_sha256()
    try:
        installed = extension_sha256([(target.parent / n).read_bytes() for n in EXTENSION_FILES])
    except FileNotFoundError:
        return ExtensionStatus(ExtensionState.MISSING, target, shipped)
    state = ExtensionState.CURRENT if installed == shipped else ExtensionState.OUTDATED
    return ExtensionStatus(state, target, shipped, installed)

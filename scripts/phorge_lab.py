"""A real Phorge (or upstream Phabricator) for the PHORGE_ROOT tests: found, configured, upgraded.

``scripts/test.sh`` runs the real-Phorge tier once per application. This finds each
application's checkout, first of:

1. the operator's own (``PHORGE_ROOT`` for Phorge, ``PHABRICATOR_ROOT`` for Phabricator);
2. the snapshots in ``../shared/phorge/`` (``PHORGE_BRIDGE_SNAPSHOTS`` elsewhere), checked
   against the checksums pinned below and extracted into a throwaway folder;
3. a shallow clone of the pinned commits, when the network allows it;

then points it at the test MariaDB under a namespace of its own and runs
``bin/storage upgrade --force``. The pins (commit and checksum of each source) live here
and nowhere else.

    python3 scripts/phorge_lab.py phorge WORKDIR --mysql-port 3307 --base-uri URI

prints the checkout's root on standard output; exits 3 with one line on standard error
saying why when no checkout could be had, and 2 when one is there but broken. Only the
standard library.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from phorge_checkout import NotACheckout, check_checkout

HERE = Path(__file__).resolve().parent
SNAPSHOTS = Path(os.environ.get("PHORGE_BRIDGE_SNAPSHOTS") or HERE.parent.parent / "shared/phorge")
PHP_MODULES = ("mysqli", "curl", "mbstring")
CLONE_TIMEOUT = 300  # seconds a shallow fetch may take before the network counts as absent


@dataclass(frozen=True)
class Source:
    """One pinned repository: where it lives, the commit, and its snapshot's checksum."""

    repository: str
    commit: str
    snapshot: str
    sha256: str


@dataclass(frozen=True)
class Application:
    """An application and its arcanist, extracted as siblings (``scripts/init/lib.php``)."""

    folder: str  # the top folder of its snapshot, and the checkout's name
    root_variable: str  # the operator's own checkout
    namespace: str  # its databases on the test MariaDB: NAMESPACE_worker, ...
    app: Source
    arcanist: Source


APPLICATIONS = {
    "phorge": Application(
        folder="phorge",
        root_variable="PHORGE_ROOT",
        namespace="bridgeinterop",
        app=Source(
            "https://github.com/phorgeit/phorge.git",
            "07c1a51310cff4d17ab727ee80fca6418cd17124",
            "phorge-07c1a51310.tar.gz",
            "23f8c7b86d7b39f7b0ff1f8ba5c4ebcd12db82f75f5df49b9e97692571e6f890",
        ),
        arcanist=Source(
            "https://github.com/phorgeit/arcanist.git",
            "3b6004a3ccbddf6c5225a38b7eb76ae26ad79704",
            "arcanist-3b6004a3.tar.gz",
            "767a9499a467b5c0b42c6e130e455a8e491fd9fa0bf39f3064f1df4c12b17453",
        ),
    ),
    "phabricator": Application(
        folder="phabricator",
        root_variable="PHABRICATOR_ROOT",
        namespace="bridgephab",
        app=Source(
            "https://github.com/phacility/phabricator.git",
            "5720a38cfe95b00ca4be5016dd0d2f3195f4fa04",
            "phabricator-5720a38cfe.tar.gz",
            "977fd9a8c7617c686e80c7c6ee643d37515adba1f8c2a85af8f6990d89dfae63",
        ),
        arcanist=Source(
            "https://github.com/phacility/arcanist.git",
            "e50d1bc4eabac9c37e3220e9f3fb8e37ae20b957",
            "phabricator-arcanist-e50d1bc4ea.tar.gz",
            "190755c2d7613c5c1ed7b4abe05e5bd408ce811b1c36054f002cc680df6a3e74",
        ),
    ),
}


class Unavailable(Exception):
    """No checkout of the application could be had; the message says what was tried."""


class Broken(Exception):
    """A checkout is there but cannot serve: a snapshot that is not the pinned one, a
    directory that is no checkout, a failed schema upgrade. The run fails."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def from_snapshots(app: Application, work: Path) -> Path:
    """The application and its arcanist extracted from the checked snapshots into ``work``."""
    tarballs = [SNAPSHOTS / source.snapshot for source in (app.app, app.arcanist)]
    missing = [str(path) for path in tarballs if not path.exists()]
    if missing:
        raise Unavailable(f"no snapshot {', '.join(missing)}")
    for source, tarball in zip((app.app, app.arcanist), tarballs, strict=True):
        found = sha256(tarball)
        if found != source.sha256:
            raise Broken(f"{tarball}: sha256 {found}, pinned {source.sha256}")
    for tarball in tarballs:
        with tarfile.open(tarball) as archive:
            archive.extractall(work, filter="tar")
    return work / app.folder


def from_clone(app: Application, work: Path) -> Path:
    """The pinned commits fetched shallowly into ``work``, or :class:`Unavailable`."""
    for source, folder in ((app.app, app.folder), (app.arcanist, "arcanist")):
        target = work / folder
        steps = (
            ["git", "init", "-q", str(target)],
            ["git", "-C", str(target), "fetch", "-q", "--depth", "1", source.repository],
            ["git", "-C", str(target), "checkout", "-q", "FETCH_HEAD"],
        )
        steps[1].append(source.commit)
        for step in steps:
            try:
                subprocess.run(step, check=True, capture_output=True, timeout=CLONE_TIMEOUT)
            except (OSError, subprocess.SubprocessError) as exc:
                said = (getattr(exc, "stderr", None) or b"").decode(errors="replace").split("\n")
                why = next((line for line in reversed(said) if line.strip()), str(exc))
                what = f"{source.repository} {source.commit}"
                raise Unavailable(f"cannot fetch {what}: {why.strip()}") from None
    return work / app.folder


def provide(name: str, work: Path) -> tuple[Path, str]:
    """The application's checkout and how it was had, first of: the operator's own, the
    snapshots, a shallow clone."""
    app = APPLICATIONS[name]
    own = os.environ.get(app.root_variable)
    if own:
        return Path(own), f"{app.root_variable}={own}"
    work.mkdir(parents=True, exist_ok=True)
    tried = []
    for how, get in (("snapshots in", from_snapshots), ("a shallow clone into", from_clone)):
        try:
            return get(app, work), f"{how} {SNAPSHOTS if get is from_snapshots else work}"
        except Unavailable as exc:
            tried.append(str(exc))
    raise Unavailable(f"no {app.root_variable}; {'; '.join(tried)}")


def configure(root: Path, app: Application, mysql_port: int, base_uri: str) -> None:
    """Point the checkout at the test MariaDB under its own namespace; upgrade its schema."""
    local = root / "conf" / "local" / "local.json"
    local.parent.mkdir(parents=True, exist_ok=True)
    config = json.loads(local.read_text()) if local.exists() else {}
    config.update(
        {
            "mysql.host": "127.0.0.1",
            "mysql.port": str(mysql_port),
            "mysql.user": "bridge",
            "mysql.pass": "bridge",
            "storage.default-namespace": app.namespace,
            "phabricator.base-uri": base_uri,
        }
    )
    local.write_text(json.dumps(config, indent=2))
    upgrade = ["php", str(root / "bin" / "storage"), "upgrade", "--force"]
    done = subprocess.run(upgrade, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise Broken(f"bin/storage upgrade failed in {root}:\n{done.stdout}{done.stderr}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("application", choices=sorted(APPLICATIONS))
    parser.add_argument("work", type=Path, help="a throwaway folder for an extracted checkout")
    parser.add_argument("--mysql-port", type=int, default=3307)
    parser.add_argument("--base-uri", default="http://127.0.0.1:8766/")
    args = parser.parse_args(argv)
    try:
        root, how = provide(args.application, args.work)
        root = check_checkout(root, php_modules=PHP_MODULES)
        configure(root, APPLICATIONS[args.application], args.mysql_port, args.base_uri)
    except Unavailable as exc:
        print(f"phorge_lab: {args.application}: {exc}", file=sys.stderr)
        return 3
    except (Broken, NotACheckout) as exc:
        print(f"phorge_lab: {args.application}: {exc}", file=sys.stderr)
        return 2
    print(f"phorge_lab: {args.application} from {how}", file=sys.stderr)
    print(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""scripts/phorge_lab.py: which checkout the real-Phorge tier gets, and what it refuses."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import tarfile
from pathlib import Path

import phorge_lab
import pytest


def snapshot(directory: Path, name: str, top: str, files: dict[str, str]) -> str:
    """A ``git archive``-like tarball of ``files`` under ``top/``; its sha256."""
    path = directory / name
    with tarfile.open(path, "w:gz") as archive:
        for relative, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{relative}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def snapshots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> phorge_lab.Application:
    """Phorge's pins pointed at two small snapshots of our own, in a folder of their own."""
    folder = tmp_path / "shared"
    folder.mkdir()
    pinned = phorge_lab.APPLICATIONS["phorge"]
    app_sum = snapshot(folder, pinned.app.snapshot, "phorge", {"bin/phd": "#!php"})
    arc_sum = snapshot(folder, pinned.arcanist.snapshot, "arcanist", {"README": "arc"})
    app = dataclasses.replace(
        pinned,
        app=dataclasses.replace(pinned.app, sha256=app_sum, repository=str(tmp_path / "none")),
        arcanist=dataclasses.replace(pinned.arcanist, sha256=arc_sum),
    )
    monkeypatch.setattr(phorge_lab, "SNAPSHOTS", folder)
    monkeypatch.setitem(phorge_lab.APPLICATIONS, "phorge", app)
    monkeypatch.delenv("PHORGE_ROOT", raising=False)
    return app


def test_pins_name_each_snapshot_once_with_a_full_commit() -> None:
    sources = [s for a in phorge_lab.APPLICATIONS.values() for s in (a.app, a.arcanist)]
    assert len({s.snapshot for s in sources}) == len(sources) == 4
    assert all(len(s.commit) == 40 and len(s.sha256) == 64 for s in sources)
    assert all(s.commit.startswith(s.snapshot.rsplit("-", 1)[1][:8]) for s in sources)


def test_the_snapshots_are_extracted_as_siblings(snapshots, tmp_path: Path) -> None:
    root, how = phorge_lab.provide("phorge", tmp_path / "work")
    assert root == tmp_path / "work" / "phorge"
    assert (root / "bin" / "phd").read_text() == "#!php"
    assert (root.parent / "arcanist" / "README").read_text() == "arc"
    assert how.startswith("snapshots in")


def test_a_snapshot_that_is_not_the_pinned_one_is_refused(snapshots, tmp_path: Path) -> None:
    tarball = phorge_lab.SNAPSHOTS / snapshots.arcanist.snapshot
    tarball.write_bytes(tarball.read_bytes() + b"\0")
    with pytest.raises(phorge_lab.Broken, match=f"{tarball.name}: sha256 .*, pinned"):
        phorge_lab.provide("phorge", tmp_path / "work")
    assert not (tmp_path / "work" / "phorge").exists()


def test_without_snapshots_or_a_clone_it_says_what_it_tried(snapshots, tmp_path) -> None:
    (phorge_lab.SNAPSHOTS / snapshots.app.snapshot).unlink()
    with pytest.raises(phorge_lab.Unavailable) as raised:
        phorge_lab.provide("phorge", tmp_path / "work")
    said = str(raised.value)
    assert said.startswith("no PHORGE_ROOT; no snapshot ")
    assert f"cannot fetch {tmp_path / 'none'} {snapshots.app.commit}" in said


def test_the_operators_own_checkout_comes_first(snapshots, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PHORGE_ROOT", "/srv/phorge")
    assert phorge_lab.provide("phorge", tmp_path / "work") == (
        Path("/srv/phorge"),
        "PHORGE_ROOT=/srv/phorge",
    )


def test_no_checkout_exits_3_and_a_broken_one_2(snapshots, tmp_path, capsys) -> None:
    tarball = phorge_lab.SNAPSHOTS / snapshots.app.snapshot
    tarball.write_bytes(b"not a tarball")
    assert phorge_lab.main(["phorge", str(tmp_path / "a")]) == 2
    tarball.unlink()
    assert phorge_lab.main(["phorge", str(tmp_path / "b")]) == 3
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[:2] for line in lines] == [["phorge_lab", " phorge"]] * 2

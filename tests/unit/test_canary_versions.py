"""A new version of a new side is judged afresh: what each worker announces as the version
of what serves a class (a native handler's distribution, the PHP code's deploy stamp),
the new side's version the guard derives from the live workers, the state that records
it, and the guard that starts a fresh judgement when it changes (on SQLite)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from canary_archive import archived, owner

from bridge.assembly import build_registry
from bridge.canary.guard import Suspicions, guard_once, note_versions
from bridge.canary.store import CanaryStore
from bridge.canary.weights import VERSION, CanaryState, canary_of
from bridge.config import load_settings
from bridge.handlers.phabricator import PhabricatorTestWorker
from bridge.handlers.registry import Coverage, Registry
from bridge.queue.implementations import CELERY, PYTHON
from bridge.routing import Router
from bridge.runtime.announce import Announcement
from bridge.runtime.canary_guard import new_side_versions
from bridge.transports.php_runner.stamp import deploy_stamp, git_head

# -- what a worker announces -----------------------------------------------------------------


def test_a_native_handler_s_version_is_its_distribution_s():
    from importlib.metadata import version

    assert PhabricatorTestWorker().version == f"phorge-bridge {version('phorge-bridge')}"
    registry = Registry([PhabricatorTestWorker()])
    assert registry.versions() == {
        f"native:{c}": PhabricatorTestWorker().version for c in PhabricatorTestWorker.task_classes
    }


def test_the_php_code_s_stamp_is_the_reload_stamp_s_time_else_the_checkout_s_commit(tmp_path):
    root = tmp_path / "phorge"
    git = root / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    assert deploy_stamp(None, root) is None, "no HEAD: no stamp"
    commit = "3b6004a3c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6"
    (git / "HEAD").write_text("ref: refs/heads/master\n")
    (git / "packed-refs").write_text(f"# pack-refs with: peeled\n{commit} refs/heads/master\n")
    assert deploy_stamp(None, root) == "git 3b6004a3c1d2", "a packed ref"
    (git / "refs" / "heads" / "master").write_text("a" * 40 + "\n")
    assert git_head(git) == "a" * 40, "a loose ref wins over the packed one"
    (git / "HEAD").write_text("b" * 40 + "\n")
    assert git_head(git) == "b" * 40, "detached"
    stamp = tmp_path / "deployed"
    assert deploy_stamp(stamp, root) == f"git {'b' * 12}", "the stamp not touched yet"
    stamp.touch()
    os.utime(stamp, (1796570000, 1796570000))
    assert deploy_stamp(stamp, root) == "deployed 1796570000"


def test_an_announcement_carries_the_versions_and_an_older_worker_s_has_none():
    coverage = Coverage(native=("A",), runner=("B*",))
    versions = {"native:A": "handlers 1.2", "runner": "git 3b6004a3c1d2"}
    reply = {"queues": ["php"], "coverage": coverage.as_dict(), "down": [], "versions": versions}
    announced = Announcement.from_reply("w@h", reply)
    assert announced.version_for("A", "native") == "handlers 1.2"
    assert announced.version_for("B1", "runner") == announced.version_for("A", "runner")
    assert announced.version_for("B1", "proxy") is None
    del reply["versions"]
    assert Announcement.from_reply("w@h", reply).versions == {}
    with pytest.raises(ValueError):
        Announcement.from_reply("w@h", {**reply, "versions": ["not", "a", "mapping"]})


# -- the new side's version, from the live workers ----------------------------------------------

ROUTER = Router((("A", "fast"),), "php")


def node(
    name: str, queues: tuple[str, ...], native: str | None, runner: str | None
) -> Announcement:
    versions = {"native:A": native, "runner": runner}
    return Announcement(
        name,
        queues,
        Coverage(native=("A",) if native else (), runner=("*",)),
        versions={k: v for k, v in versions.items() if v is not None},
    )


def test_the_new_side_s_version_is_what_the_workers_that_would_run_it_announce():
    nodes = {
        "a@h": node("a@h", ("fast",), "handlers 1.2", "git aaa"),
        "b@h": node("b@h", ("fast",), "handlers 1.3", "git aaa"),  # half deployed
        "c@h": node("c@h", ("php",), "handlers 9.9", "git ccc"),  # not on A's queue
        "d@h": node("d@h", ("fast",), None, "git ddd"),  # no handler: runs A in PHP
    }
    native = canary_of({"A": {"python": 50}}, None)
    assert new_side_versions(native, nodes, ROUTER) == {("A", PYTHON): "handlers 1.2, handlers 1.3"}
    # At the celery level, what runs the bridge's share: the PHP path while the native
    # weight is 0, the native handler where it is 100 (and PHP where there is none).
    php = canary_of({"A": {"celery": 50, "python": 0}}, None)
    assert new_side_versions(php, nodes, ROUTER) == {("A", CELERY): "git aaa, git ddd"}
    both = canary_of({"A": {"celery": 50, "python": 100}}, None)
    assert new_side_versions(both, nodes, ROUTER) == {
        ("A", CELERY): "git ddd, handlers 1.2, handlers 1.3"
    }
    assert new_side_versions(native, {}, ROUTER) == {}, "nobody announced: nothing known"


# -- the state ---------------------------------------------------------------------------------


def test_a_first_version_is_recorded_and_a_new_one_is_an_event_that_judges_afresh():
    state = CanaryState().with_version("C", PYTHON, 100, "handlers 1.2", 50)
    assert state.of("C", PYTHON).version == "handlers 1.2"
    assert state.history == () and state.judged_since("C", PYTHON) is None
    state = state.with_version("C", PYTHON, 200, "handlers 1.3", 50)
    (event,) = state.history
    assert (event.at, event.event, event.reason) == (200, VERSION, "handlers 1.2 -> handlers 1.3")
    assert state.judged_since("C", PYTHON) == 200
    assert state.judged_since("C", CELERY) is None
    promoted = state.with_promotion("C", PYTHON, 300, 50)
    assert promoted.of("C", PYTHON).version == "handlers 1.3", "a promotion keeps it"
    assert promoted.judged_since("C", PYTHON) == 300
    read = CanaryState.from_json(state.to_json())
    assert read.of("C", PYTHON).version == "handlers 1.3"
    assert read.judged_since("C", PYTHON) == 200
    with pytest.raises(ValueError):
        CanaryState.from_json({"classes": {"C": {"python": {"step": 0, "version": 12}}}})


# -- the guard ---------------------------------------------------------------------------------

WEIGHTS = {"C": {"python": 20}}


def bad_new_side(engine, age: int = 0) -> None:
    """The new side 70% successful over 40 runs, the old side 100% over 148."""
    archived(engine, owner("native"), count=28, age=age)
    archived(engine, owner("runner-fallback"), count=12, age=age)
    archived(engine, owner("runner"), count=148, age=age)


def test_a_new_version_forgets_the_suspicions_of_the_old_one(db):
    engine, _ = db
    store = CanaryStore(engine, None)
    store.set_weights(WEIGHTS)
    suspicions = Suspicions(3)
    for _ in range(2):
        suspicions.confirmed("C", PYTHON, "worse")
    canary = note_versions(store, store.read(), {("C", PYTHON): "1.2"}, 100, suspicions)
    assert canary.state.of("C", PYTHON).version == "1.2"
    assert suspicions.confirmed("C", PYTHON, "worse"), "a first sight forgets nothing"
    note_versions(store, canary, {("C", PYTHON): "1.3"}, 200, suspicions)
    assert not suspicions.confirmed("C", PYTHON, "worse"), "counted afresh from one"


def test_a_new_version_of_the_new_side_is_judged_on_its_own_runs(db, caplog):
    """Two bad evaluations of version 1.2, then 1.3 is announced: the third is a fresh
    judgement that the old version's runs do not reach (1.2's third would have rolled the
    class back); 1.3's own bad runs roll it back, after three evaluations of its own."""
    engine, settings = db
    store = CanaryStore(engine, None)
    store.set_weights(WEIGHTS)
    bad_new_side(engine, age=10)
    announced = {("C", PYTHON): "handlers 1.2"}

    def judge() -> list[str]:
        return guard_once(store, engine, settings, suspicions, versions=lambda _: announced)

    suspicions = Suspicions(3)
    assert [judge(), judge()] == [[], []]
    assert store.read().state.history == ()
    announced = {("C", PYTHON): "handlers 1.3"}
    caplog.set_level(logging.WARNING, logger="bridge.canary")
    assert judge() == []
    canary = store.read()
    (event,) = canary.state.history
    assert (event.event, event.reason) == (VERSION, "handlers 1.2 -> handlers 1.3")
    assert canary.state.judged_since("C", PYTHON) == event.at
    assert canary.weight("C", PYTHON) == 2000
    assert [r.getMessage() for r in caplog.records] == [
        "canary: C (python) runs handlers 1.3 on its new side (was handlers 1.2): "
        "judged afresh from now"
    ]
    bad_new_side(engine)
    assert [judge(), judge(), judge()] == [[], [], ["rollback C (python)"]]
    assert store.read().state.of("C", PYTHON).version == "handlers 1.3"


def test_a_version_announced_for_a_class_not_shared_is_not_recorded(db):
    engine, settings = db
    store = CanaryStore(engine, None)
    store.set_weights({"C": {"python": 100}, "D": {"python": 20}})
    versions = {("C", PYTHON): "handlers 1.2", ("D", PYTHON): "handlers 1.2"}
    assert guard_once(store, engine, settings, Suspicions(3), versions=lambda _: versions) == []
    state = store.read().state
    assert state.of("C", PYTHON).version is None
    assert state.of("D", PYTHON).version == "handlers 1.2"


def test_a_worker_announces_its_runner_s_stamp_and_no_version_for_conduit(tmp_path: Path):
    """What runs PHP: the runner, Phorge's code under it; Conduit, Phorge's web hosts,
    whose version a worker cannot see."""
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("c" * 40)
    settings = load_settings(
        {
            "BRIDGE_DATABASE_URL": "sqlite:///q.db",
            "BRIDGE_PHORGE_ROOT": str(tmp_path),
            "BRIDGE_CONDUIT_URL": "http://127.0.0.1:1/",
            "BRIDGE_CONDUIT_TOKEN": "api-abcdefghijklmnopqrstuvwxyz12",
        }
    )
    versions = build_registry(settings).versions()
    assert versions["runner"] == f"git {'c' * 12}"
    assert "proxy" not in versions
    assert versions["native:FeedPublisherHTTPWorker"].startswith("phorge-bridge ")

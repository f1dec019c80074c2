"""``phorge-bridge canary status|rollback|promote|report`` and doctor's canary check,
against MariaDB."""

from __future__ import annotations

import itertools
import json
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import pytest
import sqlalchemy as sa
from services import url_of

from bridge.canary.store import CanaryStore, decode_weights
from bridge.canary.weights import OPTION, bucket, with_weight
from bridge.cli import doctor as checks
from bridge.queue import PhorgeQueue, make_engine
from bridge.queue.implementations import CELERY, PYTHON
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive

FEED = "FeedPublisherHTTPWorker"
MAIL = "ManiphestTransactionMailWorker"
RAMPED = "PhabricatorRepositoryCommitParserWorker"
WEIGHTS = {
    "*": {"celery": 0},
    "PhabricatorSearchWorker": {"celery": 100},
    MAIL: {"celery": 5},
    FEED: {"celery": 100, "python": 20},
    RAMPED: {"ramp": {"level": "celery", "steps": [1, 5, 100], "dwell": 600}},
}


@pytest.fixture
def cli(cli_invoke, mysql_engine):
    """Run ``phorge-bridge`` against the test database; returns (invoke, store)."""
    engine = make_engine(url_of(mysql_engine))
    store = CanaryStore(engine, None)
    store.set_weights(WEIGHTS)
    yield cli_invoke, store
    engine.dispose()


def status_rows(output: str) -> dict[tuple[str, str], list[str]]:
    """``canary status``'s table by (class, level): its other columns, split on 2+ spaces."""
    lines = output.splitlines()
    header = lines[0]
    starts = [m.start() for m in re.finditer(r"\S+(?: \S+)*", header)]  # "ROLLED BACK"
    found = {}
    for line in lines[1:]:
        if line.startswith("every other class"):
            continue
        cells = [line[a:b].strip() for a, b in itertools.pairwise([*starts, None])]
        found[cells[0], cells[1]] = cells[2:]
    return found


def test_status_shows_configured_and_effective_weights(cli):
    invoke, _ = cli
    out = invoke("canary", "status")
    assert out.splitlines()[0].split() == [
        "CLASS",
        "LEVEL",
        "CONFIGURED",
        "EFFECTIVE",
        "RAMP",
        "ROLLED",
        "BACK",
    ]
    rows = status_rows(out)
    assert rows[MAIL, CELERY] == ["5%", "5%", "-", "-"]
    assert rows[MAIL, PYTHON] == ["100%", "100%", "-", "-"]
    assert rows[FEED, PYTHON] == ["20%", "20%", "-", "-"]
    assert rows[RAMPED, CELERY][:3] == ["ramp 1,5,100% (dwell 600 s)", "1%", "step 1/3 (1%)"]
    assert out.splitlines()[-1] == "every other class: celery 0%, python 100%"
    assert set(status_rows(invoke("canary", "status", FEED))) == {(FEED, CELERY), (FEED, PYTHON)}
    shown = json.loads(invoke("canary", "status", "--json"))
    assert shown["classes"][MAIL][CELERY] == {
        "configured": 5.0,
        "effective": 5.0,
        "ramp": None,
        "rolled_back": None,
        "version": None,
        "judged_since": None,
    }
    assert shown["default"] == {"celery": 0.0, "python": 100.0}


def test_rollback_then_status_shows_zero_and_promote_clears_it(cli):
    invoke, store = cli
    out = invoke("canary", "rollback", FEED, "--reason", "feed hooks answer 500")
    assert out == f"rolled back {FEED} (python): new side at 0% (was 20%)\n"
    row = status_rows(invoke("canary", "status", FEED))[FEED, PYTHON]
    assert row[:2] == ["20%", "0%"]
    assert row[3].startswith("since ") and row[3].endswith(": feed hooks answer 500")
    assert store.read().weight(FEED, PYTHON) == 0
    # Twice is harmless, and says since when.
    again = invoke("canary", "rollback", FEED)
    assert again.startswith(f"{FEED} (python) was already rolled back since ")
    assert len(store.read().state.history) == 1
    # Without --level, promote finds the level it was rolled back at.
    assert invoke("canary", "promote", FEED) == (
        f"promoted {FEED} (python): rollback cleared, new side at 20%\n"
    )
    assert status_rows(invoke("canary", "status", FEED))[FEED, PYTHON] == ["20%", "20%", "-", "-"]
    # Nothing left to promote: an error that says why.
    assert "nothing to promote" in invoke("canary", "promote", FEED, code=1)
    events = [(e.event, e.weight, e.reason) for e in store.read().state.history]
    assert events == [
        ("rollback", 0, "feed hooks answer 500"),
        ("promote", 20.0, "promoted by an operator"),
    ]


def test_promote_moves_a_ramp_and_restarts_it_after_a_rollback(cli):
    invoke, store = cli
    assert invoke("canary", "promote", RAMPED).endswith("next ramp step, new side at 5%\n")
    assert store.read().weight(RAMPED, CELERY) == 500
    invoke("canary", "rollback", RAMPED, "--level", "celery")
    assert store.read().weight(RAMPED, CELERY) == 0
    assert invoke("canary", "promote", RAMPED, "--reason", "fixed").endswith(
        "rollback cleared, new side at 1%\n"
    )
    assert store.read().state.of(RAMPED, CELERY).step == 0
    invoke("canary", "promote", RAMPED)
    invoke("canary", "promote", RAMPED)
    assert store.read().weight(RAMPED, CELERY) == 10_000
    assert "its ramp is at its last step" in invoke("canary", "promote", RAMPED, code=1)


def test_unknown_classes_and_levels_are_usage_errors(cli):
    invoke, store = cli
    out = invoke("canary", "rollback", "PhabricatorNoSuchWorker", code=2)
    assert "unknown class 'PhabricatorNoSuchWorker'" in out
    assert (
        "invalid value for '--level'"
        in invoke("canary", "rollback", FEED, "--level", "php", code=2).lower()
    )
    assert "unknown class" in invoke("canary", "report", "Nope", code=2)
    assert "unknown class" in invoke("canary", "status", "Nope", code=2)
    # A class the option does not name, but the queue holds: it can be rolled back.
    PhorgeQueue(store.engine).enqueue("PhabricatorTestWorker", {})
    out = invoke("canary", "rollback", "PhabricatorTestWorker", "--level", "python")
    assert out == "rolled back PhabricatorTestWorker (python): new side at 0% (was 100%)\n"


_ids = itertools.count(1)


def archived(engine: sa.Engine, task_class: str, label: str | None, count: int, **row) -> None:
    with engine.connect() as conn:
        now = int(conn.exec_driver_sql("SELECT UNIX_TIMESTAMP()").scalar_one())
    owner = f"bridge:{label}:7:{now}:host:1" if label else f"7:{now}:host:1"
    values = {
        "taskClass": task_class,
        "leaseOwner": owner,
        "failureCount": 0,
        "dataID": 1,
        "result": 0,
        "duration": 20_000,
        "dateCreated": now,
        "dateModified": now,
        "priority": 3000,
        **row,
    }
    with engine.begin() as conn:
        conn.execute(sa.insert(archive), [{**values, "id": next(_ids)} for _ in range(count)])


def test_report_shows_both_sides_from_labelled_archive_rows(cli):
    invoke, store = cli
    engine = store.engine
    archived(engine, FEED, "native", 8, duration=40_000)
    archived(engine, FEED, "runner-fallback", 2)
    archived(engine, FEED, "runner", 20, duration=10_000)
    archived(engine, FEED, "runner", 1, failureCount=2, result=1)
    archived(engine, FEED, "runner", 3, dateModified=1)  # long ago: outside the window
    invoke("canary", "rollback", FEED, "--reason", "too slow")
    shown = json.loads(invoke("canary", "report", FEED, "--json"))
    (entry,) = shown["classes"]
    assert (entry["class"], entry["level"], entry["window"]) == (FEED, PYTHON, 300)
    assert entry["new"] == {
        "runs": 10,
        "successes": 8,
        "temporary_failures": 0,
        "permanent_failures": 0,
        "fallbacks": 2,
        "p50": 0.04,
        "p99": 0.04,
        "implementations": ["native"],
        "ratio": 0.8,
        "followups": 0,
        "labelled_successes": 8,
        "yield_loops": 0,
        "followups_per_success": 0.0,
    }
    old = entry["old"]
    assert (old["runs"], old["successes"], old["temporary_failures"]) == (2 + 20 + 3, 22, 2)
    assert (old["permanent_failures"], old["fallbacks"]) == (1, 0)
    assert old["implementations"] == ["runner", "runner-fallback"]
    assert (entry["configured"], entry["effective"]) == (20.0, 0.0)
    assert entry["rolled_back"]["reason"] == "too slow"
    assert [(e["event"], e["reason"]) for e in entry["history"]] == [("rollback", "too slow")]

    # A day, summed by the server: the row long ago too, and no durations.
    (day,) = json.loads(invoke("canary", "report", FEED, "--since", "24h", "--json"))["classes"]
    assert day["window"] == 86_400
    assert day["new"] == {**entry["new"], "p50": None, "p99": None}
    assert day["old"]["runs"] == old["runs"]  # dateModified=1 is older than a day too
    assert "is not a span" in invoke("canary", "report", "--since", "soon", code=2)
    assert "give one" in invoke("canary", "report", "--since", "1h", "--window", "5", code=2)

    text = invoke("canary", "report", FEED).splitlines()
    assert text[0] == f"{FEED} (python level), archived runs of the last 300 s"
    header, new, old_line = (line.split() for line in text[1:4])
    assert header[:3] == ["SIDE", "RUNS", "SUCCESS"]
    assert new == [
        "new", "10", "80.0%", "0.040", "s", "0.040", "s", "0", "0", "2", "0.00/run", "native"
    ]  # fmt: skip
    assert old_line[:3] == ["old", "25", "88.0%"]
    assert text[4].startswith("weight: 0% on the new side (configured 20%), rolled back since ")
    assert text[5] == "new side's version: not announced"
    assert text[6] == "history:" and text[7].endswith("python  rollback     0%  too slow")
    # A shorter window, and every named class without CLASS.
    assert json.loads(invoke("canary", "report", FEED, "--window", "1", "--json"))
    every = json.loads(invoke("canary", "report", "--json"))["classes"]
    assert [e["class"] for e in every] == sorted([FEED, MAIL, RAMPED, "PhabricatorSearchWorker"])
    assert {e["class"]: e["level"] for e in every}[MAIL] == CELERY


def test_report_at_the_bridge_level_reads_phd_owners(cli):
    invoke, store = cli
    archived(store.engine, MAIL, None, 4)  # Phorge's own taskmasters: pid:epoch:host:seq
    archived(store.engine, MAIL, "native", 1)
    with store.engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE worker_archivetask SET leaseOwner = CONCAT('phd:', leaseOwner)"
            " WHERE id = (SELECT MIN(id) FROM (SELECT id FROM worker_archivetask) ids)"
        )
    (entry,) = json.loads(invoke("canary", "report", MAIL, "--json"))["classes"]
    assert (entry["new"]["runs"], entry["old"]["runs"]) == (1, 4)
    assert entry["old"]["implementations"] == ["phd"]


def doctor() -> dict:
    """Doctor's canary check, after the two it needs (the whole of doctor probes the broker)."""
    run = checks.Doctor()
    for check in (checks.check_settings, checks.check_database, checks.check_canary):
        result = run.run(check)
    return asdict(result)


def test_doctor_lists_the_weights_warns_of_rollbacks_and_fails_bad_weights(cli):
    invoke, store = cli
    assert checks.check_canary in checks.CHECKS

    check = doctor()
    assert check["status"] == "ok"
    assert check["detail"] == (
        f"weights: {FEED} python 20% (shared); {MAIL} celery 5% (shared); "
        f"{RAMPED} celery 1% (shared); PhabricatorSearchWorker 100%; "
        "every other class: celery 0%, python 100%"
    )
    invoke("canary", "rollback", FEED, "--reason", "bad hooks")
    check = doctor()
    assert check["status"] == "warn"
    assert f"{FEED} (python) rolled back since " in check["detail"]
    assert ": bad hooks; once fixed, run `phorge-bridge canary promote " in check["detail"]
    assert f"canary promote {FEED} --level python`" in check["detail"]
    store._write("phorge-bridge.canary", lambda _old: '{"X": {"celery": 500}}')
    check = doctor()
    assert check["status"] == "fail"
    assert check["detail"].startswith("phorge-bridge.canary: X.celery: 500 is outside [0, 100]")
    assert "phorge-bridge.canary: X.celery" in invoke("canary", "status", code=1)


def test_doctor_fails_while_the_account_may_not_read_the_weights(
    cli, mysql_engine, mysql_server, monkeypatch
):
    """The bridge then runs no class that may be shared: doctor names the grant to add,
    or BRIDGE_CANARY=false for an install without a canary."""
    name, database = f"nocfg_{secrets.token_hex(4)}", mysql_engine.url.database
    with mysql_server.begin() as conn:
        conn.exec_driver_sql(f"CREATE USER '{name}'@'127.0.0.1' IDENTIFIED BY 'rw'")
        conn.exec_driver_sql(
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON `{database}`.worker_activetask "
            f"TO '{name}'@'127.0.0.1'"
        )
    try:
        url = mysql_engine.url.set(username=name, password="rw")
        monkeypatch.setenv("BRIDGE_DATABASE_URL", url.render_as_string(hide_password=False))
        check = doctor()
        assert check["status"] == "fail"
        assert check["detail"].startswith("weights unknown, so the bridge runs no class that")
        assert check["detail"].endswith(
            "this account may not use Phorge's config table: GRANT SELECT, INSERT, UPDATE "
            f"ON config_entry TO '{name}'@'127.0.0.1'"
        )
        monkeypatch.setenv("BRIDGE_CANARY", "false")
        check = doctor()
        assert (check["status"], check["detail"]) == (
            "ok",
            "off (BRIDGE_CANARY=false): every class wholly on the bridge",
        )
    finally:
        with mysql_server.begin() as conn:
            conn.exec_driver_sql(f"DROP USER '{name}'@'127.0.0.1'")


def raw_weights(store: CanaryStore) -> Any:
    """The option as its row holds it, decoded as PHP decodes it."""
    return decode_weights(store.read_values()[OPTION])


def test_set_and_unset_change_one_class_and_level_and_keep_the_rest(cli):
    invoke, store = cli
    assert invoke("canary", "set", MAIL, "25") == (f"{MAIL} (celery): new side at 25% (was 5%)\n")
    assert invoke("canary", "set", "HeraldWebhookWorker", "12.5", "--level", "python") == (
        "HeraldWebhookWorker (python): new side at 12.5% (was 100%)\n"
    )
    assert raw_weights(store) == {
        **WEIGHTS,
        MAIL: {"celery": 25},
        "HeraldWebhookWorker": {"python": 12.5},
    }
    # Left out, a class's celery level is the default's: naming it at python kept it on phd.
    assert store.read().weight("HeraldWebhookWorker", CELERY) == 0
    assert invoke("canary", "unset", MAIL) == (
        f"{MAIL} (celery): new side at 0% (was 25%)\n{MAIL} (python): new side at 100% (was 100%)\n"
    )
    invoke("canary", "unset", FEED, "--level", "python")
    assert raw_weights(store)[FEED] == {"celery": 100}
    assert MAIL not in raw_weights(store)


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        ((FEED, "50"), f"{FEED}: only one level may be shared at a time"),
        (("*", "50"), "*: the default weights are 0 or 100, without a ramp or guard"),
        ((RAMPED, "50"), f"{RAMPED}: its ramp sets the celery weight (unset it first)"),
    ],
)
def test_set_refuses_in_one_line_what_cannot_be_honoured(cli, args, refusal):
    invoke, store = cli
    before = store.read_values()
    out = invoke("canary", "set", *args, code=1)
    assert out == f"Error: phorge-bridge.canary: {refusal} (in config_entry)\n"
    assert store.read_values() == before
    assert "Error: phorge-bridge.canary: Nobody: not named" in invoke(
        "canary", "unset", "Nobody", code=1
    )
    assert "is not in the range 0<=x<=100" in invoke("canary", "set", MAIL, "101", code=2)


def test_concurrent_edits_lose_nothing(cli, mysql_engine):
    """Edits of different classes from two processes' worth of threads, each a read,
    a change and a write: every one of them is in the option afterwards."""
    _, store = cli
    classes = [f"Class{n}" for n in range(20)]

    def edit(task_class: str) -> None:
        other = CanaryStore(make_engine(url_of(mysql_engine)), None)
        other.edit_weights(lambda value: with_weight(value, task_class, CELERY, 1))
        other.engine.dispose()

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(edit, classes))
    assert {c: raw_weights(store)[c] for c in classes} == {c: {"celery": 1} for c in classes}
    assert raw_weights(store)[MAIL] == WEIGHTS[MAIL]


def test_pause_holds_a_ramp_and_resume_restarts_its_dwell(cli):
    invoke, store = cli
    out = invoke("canary", "pause", RAMPED)
    assert out.startswith(f"paused the ramp of {RAMPED} (celery): step 1/3 (1%) since ")
    assert out.endswith(", paused\n")
    assert store.read().state.of(RAMPED, CELERY).paused
    assert invoke("canary", "pause", RAMPED, code=1) == (
        f"Error: {RAMPED} (celery): its ramp is already paused\n"
    )
    assert "ramp 1,5,100% (dwell 600 s)" in invoke("canary", "status", RAMPED)
    assert status_rows(invoke("canary", "status", RAMPED))[RAMPED, CELERY][2].endswith(", paused")
    out = invoke("canary", "resume", RAMPED)
    assert out.startswith(f"resumed the ramp of {RAMPED} (celery): step 1/3 (1%) since ")
    assert not store.read().state.of(RAMPED, CELERY).paused
    assert [e.event for e in store.read().state.history] == ["pause", "resume"]
    assert invoke("canary", "pause", MAIL, code=1) == (
        f"Error: {MAIL} has no ramp at the celery level to pause\n"
    )


def test_report_counts_each_sides_rows_in_a_yield_loop_as_the_guard_does(cli):
    """Rows still yielding past ``max_yielding`` are failed runs of their side (by the
    share's hash; one that fell back is the old side's); a younger yield is not."""
    invoke, store = cli
    engine = store.engine
    archived(engine, FEED, "native", 8)
    with engine.begin() as conn:
        now = int(conn.execute(sa.select(sa.func.unix_timestamp())).scalar_one())
        ids = itertools.count(10_000)
        rows = []
        for created, failure_time, count in ((now - 7200, None, 2), (now - 7200, now, 1)):
            while count:
                task_id = next(ids)
                new = bucket(PYTHON, task_id) < 2000
                if failure_time is None and not new:
                    continue
                rows.append(yielded(task_id, created, failure_time))
                count -= 1
        rows.append(yielded(next(ids), now - 60, None))  # young: Phorge's "not yet"
        conn.execute(sa.insert(active), rows)
    out = invoke("canary", "report", FEED, "--level", "python")
    assert (
        "in a yield loop now (counted as failed runs): 2 rows on the new side, 1 on the old" in out
    )
    shown = json.loads(invoke("canary", "report", FEED, "--level", "python", "--json"))
    (entry,) = shown["classes"]
    assert (entry["new"]["yield_loops"], entry["old"]["yield_loops"]) == (2, 1)
    # 8 archived, 2 looping, and the row that fell back (a new-side failure when it did)
    assert (entry["new"]["runs"], entry["new"]["successes"]) == (8 + 2 + 1, 8)


def yielded(task_id: int, created: int, failure_time: int | None) -> dict[str, Any]:
    return {
        "id": task_id,
        "taskClass": FEED,
        "leaseOwner": "(yield)",
        "leaseExpires": created + 7200 + 30,
        "failureCount": 0,
        "dataID": 1,
        "failureTime": failure_time,
        "priority": 3000,
        "dateCreated": created,
        "dateModified": created,
    }

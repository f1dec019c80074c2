"""The canary (issue 28) on a real Phorge: runs only when PHORGE_ROOT is set.

Real Maniphest work (``maniphest.edit`` inside Phorge, see ``tests/helpers/canary_phorge.py``),
the shipped ``PhorgeBridgeQueueDaemon`` under ``bin/phd debug`` and a bridge (``celery
worker`` and ``celery beat``, RabbitMQ) on the install's own worker database, the
weights set with ``bin/config set --database`` as docs/canary.md
tells an operator to:

1. phd and the bridge share the transaction publisher at 50%: each task runs once, on the
   side its hash names, and both sides' tasks leave Phorge's effects (feed story, search
   index, mail).
2. A bridge whose handler of the search indexer is broken, at 50%, is rolled back by the
   guard; phd takes the whole class within seconds, and no task is archived failed.
3. The shipped native ``FeedPublisherHTTPWorker`` at 50% against Phorge's own PHP class
   (the runner) with a real hook receiver: every story reaches each hook exactly once,
   and the two sides' POST bodies agree field by field.

Every wait is on a condition in the database (or the receiver), never a fixed time.
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import pytest
from bridge_harness import Bridge, deployments
from canary_phorge import (
    CHAIN,
    FEED,
    HOOK,
    HOOKS_OPTION,
    MAIL,
    PUBLISH,
    SEARCH,
    RealLab,
    diagnosis,
    gray_lab,
    pair_up,
    poll,
    start_bridge,
    with_broken_handler,
)
from phorge_daemon import DAEMON, daemon
from phorge_env import HookReceiver, hook_receiver, php_server

from bridge.canary.guard import read_window
from bridge.canary.weights import SCALE, STATE_OPTION, LevelState, bucket, label_parts
from bridge.config import load_settings
from bridge.queue.implementations import CELERY, PYTHON
from bridge.queue.model import label_of
from bridge.runtime.daemon_console import BEAT as BEAT_DAEMON
from bridge.runtime.daemon_console import WORKER as WORKER_DAEMON
from bridge.runtime.daemon_console import ConsoleEntry

HALF = SCALE // 2
EDITS = 20
# Tests 1 and 3 are about sharing, not the guard: it judges no sample this small. (With
# the defaults, on this 2-core lab, the first publishes of freshly started runner
# processes, 0.15-0.6 s against phd's 0.05 s, tripped the slowdown bound: a healthy
# bridge rolled back.)
QUIET_GUARD = "100000"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealLab]:
    with gray_lab(tmp_path_factory.mktemp("gray")) as held:
        yield held


@pytest.fixture
def fresh(lab: RealLab) -> RealLab:
    """No canary state, and none of the module's rows left queued by an earlier test."""
    lab.forget_option(STATE_OPTION)
    lab.cancel_leftovers()
    return lab


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Any]:
    with deployments(tmp_path, Bridge) as factory:
        yield factory


def done_effects(effects: dict[str, Any]) -> bool:
    """Whether an edit's work has all run: its story published, indexed, its mail run
    (void: no mailer) rather than still queued."""
    mails = effects["mails"]
    return (
        effects["feedStories"] >= 1
        and effects["indexed"] >= 1
        and mails
        and ("queued" not in mails)
    )


def settled(lab: RealLab, after: int, phids: list[str], publishes: int) -> Any:
    """The chain's rows above ``after`` and the edits' effects once nothing is queued and
    every edit's work is done; None before."""
    rows = lab.tasks(after)
    if any(not row["archived"] for row in rows.values()):
        return None
    if sum(1 for row in rows.values() if row["taskClass"] == PUBLISH) < publishes:
        return None
    effects = lab.effects(phids)
    if not all(done_effects(e) for e in effects.values()):
        return None
    again = lab.tasks(after)  # a follow-up queued meanwhile (Phorge queues them after archiving)
    if any(not row["archived"] for row in again.values()):
        return None
    return again, effects


def runs_in_log(text: str, task_class: str) -> Counter[int]:
    """The bridge's outcome lines (``Class#id [impl]: outcome``, not Celery's own line
    quoting it), by task id."""
    return Counter(int(n) for n in re.findall(rf"\] {task_class}#(\d+) \[[\w-]+\]: ", text))


# -- 1. phd and the bridge share one queue ------------------------------------------------------


def test_phd_and_the_bridge_share_maniphest_publishing_at_50_percent(
    fresh: RealLab, make: Any, amqp_url: str
) -> None:
    lab = fresh
    # The publisher shared; what it queues stays with phd, as while moving class by class.
    lab.set_weights({PUBLISH: {"celery": 50}, SEARCH: {"celery": 0}, FEED: {"celery": 0},
                     MAIL: {"celery": 0}, HOOK: {"celery": 0}})  # fmt: skip
    bridge = make(
        lab.url,
        amqp_url,
        PHORGE_ROOT=str(lab.phorge.root),
        HANDLERS_INCLUDE=PUBLISH,
        CANARY_REFRESH="0.25",
        CANARY_MIN_RUNS=QUIET_GUARD,
    )
    after = lab.max_id()
    with daemon(lab) as d:
        worker = start_bridge(bridge)
        show = diagnosis(lab, bridge, d, after)
        began = time.monotonic()
        phids = lab.edit(EDITS)
        rows, effects = poll(
            pair_up(lambda: settled(lab, after, phids, EDITS), d, show),
            "every edit's work run",
            interval=0.25,
            diagnose=show,
        )
        took = time.monotonic() - began
        archived_by_phd = {i for i, r in rows.items() if label_of(r["leaseOwner"]) == "phd"}
        # The overseer relays the daemon's lines as it reads them: wait for the last ones.
        phd_ran = poll(
            lambda: (ran := d.worked_on()) and set(ran) >= archived_by_phd and ran,
            "the daemon's log to name every task it archived",
            diagnose=d.tail,
        )
        console = lab.call("console")
    bridge_log = worker.log()

    publish = {i: r for i, r in rows.items() if r["taskClass"] == PUBLISH}
    assert sorted(r["objectPHID"] for r in publish.values()) == sorted(phids)
    assert all(r["result"] == 0 and r["failureCount"] == 0 for r in rows.values()), show()
    bridges = {i for i in publish if bucket(CELERY, i) < HALF}
    phds = set(publish) - bridges
    assert len(bridges) >= 2 and len(phds) >= 2, (bridges, phds)
    # By the side the hash names, each once: the archive's owner, the daemon's leases and
    # the bridge's outcome lines say the same.
    for i, row in publish.items():
        owner = row["leaseOwner"]
        if i in bridges:
            # Publishing queues its follow-ups: the label counts them (runner~3).
            who, followups = label_parts(label_of(owner))
            assert owner.startswith("bridge:runner") and who == "runner" and followups, row
        else:
            assert owner.startswith("phd:") and label_of(owner) == "phd", row
    assert len(phd_ran) == len(set(phd_ran)), "the daemon leased a task twice"
    assert set(phd_ran) & set(publish) == phds
    assert runs_in_log(bridge_log, PUBLISH) == Counter(bridges)
    assert f"{PUBLISH}#{min(bridges)} [runner]: success" in bridge_log
    followups = {i: r for i, r in rows.items() if r["taskClass"] != PUBLISH}
    assert {r["taskClass"] for r in followups.values()} == {SEARCH, FEED, MAIL}
    assert all(label_of(r["leaseOwner"]) == "phd" for r in followups.values())
    assert set(phd_ran) == phds | set(followups)
    # Phorge's effects, alike for both sides' tasks: one story each (a second run would
    # publish a second), indexed, the transactions, the mail run.
    by_side = {
        side: {json.dumps(effects[publish[i]["objectPHID"]], sort_keys=True) for i in ids}
        for side, ids in (("bridge", bridges), ("phd", phds))
    }
    assert by_side["bridge"] == by_side["phd"] and len(by_side["phd"]) == 1, by_side
    (shape,) = (json.loads(e) for e in by_side["phd"])
    assert shape["feedStories"] == 1 and shape["indexed"] == 1 and shape["transactions"] >= 2
    assert shape["mails"] and set(shape["mails"]) == {"void"}, shape
    assert not lab.store.read().state.levels, "nothing rolled back meanwhile"
    # Phorge's Daemons console showed what ran the queue: the shipped daemon, and the
    # bridge's worker and beat by their main processes, each running on this host.
    (beat,) = (p for p in bridge.processes if p.name == "beat")
    running = {(c["daemon"], c["pid"] if c["daemon"] != DAEMON else 0): c for c in console}
    for key in ((WORKER_DAEMON, worker.pid), (BEAT_DAEMON, beat.pid), (DAEMON, 0)):
        shown = running.get(key)
        assert shown and shown["status"] == "run" and shown["shown"], (key, console)
        assert shown["host"] == socket.gethostname(), shown
    medians = [statistics.median(publish[i]["duration"] for i in ids) / 1e6
               for ids in (bridges, phds)]  # fmt: skip
    print(f"\n{EDITS} edits: {len(bridges)} published by the bridge, {len(phds)} by phd, "
          f"{len(rows)} tasks in {took:.1f} s; median publish {medians[0]:.3f} s on the "
          f"bridge's runner, {medians[1]:.3f} s on phd")  # fmt: skip


def test_phorges_daemons_console_judges_a_bridge_process_as_its_own_daemons(
    fresh: RealLab,
) -> None:
    """Read through Phorge's own query and list view: a listed process is a running
    daemon with its host, pid and user; Phorge calls it unknown when its heartbeat is
    over 360 s old and stops listing it once it exited."""
    lab = fresh
    settings = load_settings({"BRIDGE_DATABASE_URL": lab.url})
    entry = ConsoleEntry.for_settings(settings, WORKER_DAEMON, ["worker"])
    assert entry is not None, "the lab's worker database has its daemon database beside"

    def mine() -> list[tuple[str, bool]]:
        return [
            (c["status"], c["shown"])
            for c in lab.call("console")
            if c["daemon"] == WORKER_DAEMON and c["pid"] == os.getpid()
        ]

    entry.beat()  # listed, as start() does, without its heartbeat thread
    try:
        assert mine() == [("run", True)]
        lab.sql(
            f"UPDATE `{lab.daemon_db}`.daemon_log SET dateModified = dateModified - 400"
            " WHERE daemonID = :id",
            id=entry.daemon_id,
        )
        assert mine() == [("unknown", True)], "a missed heartbeat is still alive to Phorge"
        entry.beat()
        assert mine() == [("run", True)]
    finally:
        entry.stop()
    assert mine() == []


# -- 2. a broken bridge is rolled back --------------------------------------------------------

WINDOW = 20  # the guard's window (s): this test's runs only, see the first wait
MIN_RUNS, MIN_FAILURES = 4, 3
BACKLOG = 16  # rows queued for the bridge before it starts: more than it fails to trip
HONOURED_WITHIN = 5.0  # the target: every process honours a rollback within 5 s


def bridge_hashed(ids: set[int]) -> set[int]:
    return {i for i in ids if bucket(CELERY, i) < HALF}


def test_a_broken_bridge_is_rolled_back_and_phd_takes_the_class(
    fresh: RealLab, make: Any, amqp_url: str
) -> None:
    lab = fresh
    # The indexer shared, the rest of the chain phd's.
    lab.set_weights({SEARCH: {"celery": 50}, PUBLISH: {"celery": 0}, FEED: {"celery": 0},
                     MAIL: {"celery": 0}, HOOK: {"celery": 0}})  # fmt: skip
    bridge = make(
        lab.url,
        amqp_url,
        HANDLERS_INCLUDE=SEARCH,
        CANARY_REFRESH="0.25",
        CANARY_GUARD_INTERVAL="0.5",
        CANARY_WINDOW=str(WINDOW),
        # The long window too: a day of it holds the earlier modules' runs of the class on
        # the bridge, failures included, which tripped the guard (44.9% over 49 runs)
        # after 3 of this test's fallbacks in one CI run.
        CANARY_HISTORY=str(WINDOW),
        CANARY_MIN_RUNS=str(MIN_RUNS),
        CANARY_MIN_FAILURES=str(MIN_FAILURES),
    )
    with_broken_handler(bridge, SEARCH, seconds=0.25)
    # The guard judges what it reads in its windows: none of it may be an earlier run's
    # (a quick re-run of the module waits for the last one's bridge runs to age out).
    poll(
        lambda: read_window(lab.worker, SEARCH, CELERY, WINDOW, 500).new.runs == 0,
        "no bridge run of the class in the guard's window",
        timeout=WINDOW + 5,
        interval=0.5,
    )
    after = lab.max_id()
    with daemon(lab) as d:
        show = diagnosis(lab, bridge, d, after)
        phids = lab.edit(EDITS)
        indexes = len(phids)  # search rows queued: one per edit, then one per reindex

        def backlog() -> set[int] | None:
            """The bridge's share of the index, queued for it (its workers not started),
            once phd has run everything else."""
            rows = lab.tasks(after)
            search = {i for i, r in rows.items() if r["taskClass"] == SEARCH}
            if len(search) < indexes or any(
                not r["archived"] for i, r in rows.items() if i not in search
            ):
                return None
            queued = {i for i in search if not rows[i]["archived"]}
            return queued if queued == bridge_hashed(search) else None

        queued = poll(pair_up(backlog, d, show), "phd's share run", interval=0.25, diagnose=show)
        while len(queued) < BACKLOG:  # about half of each round is the bridge's
            lab.reindex(phids)
            indexes += len(phids)
            queued = poll(
                pair_up(backlog, d, show), "phd's share run", interval=0.25, diagnose=show
            )
        assert all(lab.tasks(after)[i]["leaseOwner"] is None for i in queued)

        worker = start_bridge(bridge)  # broken: each of its runs raises

        def rolled_back() -> LevelState | None:
            state = lab.store.read().state.of(SEARCH, CELERY)
            return state if state.rolled_back else None

        state = poll(pair_up(rolled_back, d, show), "the guard's rollback", diagnose=show)
        seen = time.monotonic()
        # The backlog's rows not yet archived: phd's now, leased by the bridge or not.
        waiting = {i for i, r in lab.tasks(after, [SEARCH]).items() if not r["archived"]}
        poll(
            pair_up(lambda: lab.archived_all(after, [SEARCH], waiting), d, show),
            "phd to take the class's rows left at the rollback",
            diagnose=show,
        )
        taken = time.monotonic() - seen
        # More of the class after the rollback (forced reindexing, as `bin/search index
        # --force` queues it), until some of it hashes to the bridge's side.
        later: set[int] = set()
        latency = 0.0
        while len(bridge_hashed(later)) < 3:
            before = lab.max_id()
            since = lab.reindex(phids)
            queued_at = time.monotonic()
            made = set(lab.tasks(before, [SEARCH]))
            poll(
                pair_up(lambda before=before: lab.archived_all(before, [SEARCH]), d, show),
                "the later rows run",
                diagnose=show,
            )
            latency = max(latency, time.monotonic() - queued_at)
            later |= made
            assert all(epoch >= since for epoch in lab.index_epochs(phids).values())
        rows, effects = poll(
            pair_up(lambda: settled(lab, after, phids, len(phids)), d, show),
            "every edit's work run",
            interval=0.25,
            diagnose=show,
        )
    search = {i: r for i, r in rows.items() if r["taskClass"] == SEARCH}
    labels = {i: label_of(r["leaseOwner"]) for i, r in rows.items()}
    # No task archived failed, none even counted a failure: each fallback ran on phd.
    assert {r["result"] for r in rows.values()} == {0}, show()
    assert {r["failureCount"] for r in rows.values()} == {0}
    assert set(labels.values()) <= {"phd", "phd-fallback"}, labels
    fell_back = {i for i, label in labels.items() if label == "phd-fallback"}
    assert fell_back <= queued and len(fell_back) >= MIN_RUNS, (fell_back, queued)
    # The bridge's broken runs: each one fell back, once; none started after the rollback
    # had reached the bridge (the trip's time is the database's whole second).
    ran = [run for run in bridge.runs() if run["taskClass"] == SEARCH]
    assert Counter(run["id"] for run in ran) == Counter(fell_back)
    last_run = max(run["time"] for run in ran) - state.rolled_back_at
    assert last_run <= 1 + HONOURED_WITHIN
    # What the rollback left queued, and everything queued after it, ran on phd: the
    # bridge's hash or not, within seconds.
    assert {labels[i] for i in queued - fell_back} <= {"phd"}
    # (Every row before it was queued before the bridge started, seconds earlier.)
    after_rollback = {i for i, r in search.items() if r["dateCreated"] >= state.rolled_back_at}
    assert after_rollback == later and bridge_hashed(later)
    assert {labels[i] for i in after_rollback} == {"phd"}
    assert taken < HONOURED_WITHIN, f"phd took the rows left at the rollback in {taken:.1f} s"
    assert latency < HONOURED_WITHIN, f"phd ran the rows queued after it in {latency:.1f} s"
    # Phorge's effects for every edit, the index included.
    assert all(done_effects(e) and e["indexed"] == 1 for e in effects.values())
    # The rollback as Phorge reads it (its config stack), and the ERROR line.
    shown = lab.config(STATE_OPTION)
    rolled = shown["classes"][SEARCH][CELERY]["rolled_back"]
    assert rolled["at"] == state.rolled_back_at
    assert rolled["reason"].startswith("new side success 0.0 percent over "), rolled
    assert [e["event"] for e in shown["history"] if e["class"] == SEARCH] == ["rollback"]
    assert f"canary rollback: {SEARCH} (celery): new side success 0.0%" in bridge.logs()
    assert worker.running()
    print(f"\nrolled back after {len(fell_back)} fallbacks of {len(queued)} queued rows "
          f"({rolled['reason']}; the last began {last_run:+.1f} s from the trip's second); "
          f"phd took the {len(waiting)} left in {taken:.1f} s, and ran {len(later)} later "
          f"ones within {latency:.1f} s")  # fmt: skip


# -- 3. the native feed hook against PHP's -------------------------------------------------------


@pytest.fixture
def receiver() -> Iterator[HookReceiver]:
    with hook_receiver() as server:
        yield server


PHID = re.compile(r"PHID-[A-Z]{4}(-[A-Z]{4})?-[a-z0-9]+")


def kind(value: str) -> str:
    """A form value's type, as a receiver would parse it."""
    if re.fullmatch(r"-?\d+", value):
        return "integer"
    if value.startswith("PHID-"):
        return "phid"
    return "empty" if value == "" else "string"


def test_native_feed_hooks_at_50_percent_post_what_phorge_posts(
    fresh: RealLab, make: Any, amqp_url: str, receiver: HookReceiver, tmp_path: Path
) -> None:
    lab = fresh
    hooks = [f"{receiver.base}/hook/a", f"{receiver.base}/hook/b"]
    lab.set_weights({HOOK: {"python": 50}})
    base_uri = str(lab.env["baseURI"]).rstrip("/")
    with lab.local_option(HOOKS_OPTION, hooks), php_server(lab.phorge.root, base_uri, tmp_path):
        bridge = make(
            lab.url,
            amqp_url,
            PHORGE_ROOT=str(lab.phorge.root),
            CONDUIT_URL=base_uri,
            CONDUIT_TOKEN=lab.env["token"],
            HANDLERS_INCLUDE=",".join(CHAIN),
            CANARY_REFRESH="0.25",
            CANARY_MIN_RUNS=QUIET_GUARD,
        )
        worker = start_bridge(bridge)
        after = lab.max_id()
        show = diagnosis(lab, bridge, None, after)
        edits = 10
        phids = lab.edit(edits)

        def posted() -> Any:
            return settled(lab, after, phids, edits) if len(receiver.posts) >= 2 * edits else None

        rows, _effects = poll(
            posted,
            "every story's hooks posted",
            interval=0.25,
            diagnose=lambda: f"{len(receiver.posts)} POST(s)\n{show()}",
        )
    stories = lab.stories(phids)
    assert all(len(s) == 1 for s in stories.values()), stories
    story_of = {s[0]["key"]: s[0] for s in stories.values()}
    by_id = {s["id"]: s for s in story_of.values()}

    hook_rows = {i: r for i, r in rows.items() if r["taskClass"] == HOOK}
    data = lab.data(hook_rows)
    assert {r["result"] for r in hook_rows.values()} == {0}
    assert {r["failureCount"] for r in hook_rows.values()} == {0}
    # Who delivered each (story, hook): the side the native hash names.
    side: dict[tuple[int, str], str] = {}
    for i, row in hook_rows.items():
        label = label_of(row["leaseOwner"])
        assert label == ("native" if bucket(PYTHON, i) < HALF else "runner"), (i, row)
        story = story_of[str(data[i]["key"])]
        side[(story["id"], data[i]["uri"])] = label
    assert set(side) == {(s, uri) for s in by_id for uri in hooks}
    assert Counter(side.values())["native"] >= 2 and Counter(side.values())["runner"] >= 2

    # Exactly one POST per story and hook.
    delivered: Counter[tuple[int, str]] = Counter()
    posts_by_side: dict[str, list[dict[str, Any]]] = {"native": [], "runner": []}
    for post in receiver.posts:
        fields = dict(parse_qsl(post["body"], keep_blank_values=True))
        key = (int(fields["storyID"]), receiver.base + post["path"])
        delivered[key] += 1
        posts_by_side[side[key]].append({**post, "story": key[0]})
    assert delivered == Counter(dict.fromkeys(side, 1)), delivered

    # Field by field: the same keys in the same order (the story's own PHIDs in them
    # aside), of the same types, and every value what Phorge's own worker computes for
    # the story (all of them are the story's).
    shapes = {
        name: {tuple((PHID.sub("PHID-*", k), kind(v))
                     for k, v in parse_qsl(p["body"], keep_blank_values=True))
               for p in posts}
        for name, posts in posts_by_side.items()
    }  # fmt: skip
    assert shapes["native"] == shapes["runner"], shapes
    for name, posts in posts_by_side.items():
        for post in posts:
            expected = parse_qsl(by_id[post["story"]]["body"], keep_blank_values=True)
            got = parse_qsl(post["body"], keep_blank_values=True)
            assert got == expected, (name, post["story"])
            assert post["body"] == by_id[post["story"]]["body"], name
    # A story both sides delivered (one hook each): the very same bytes.
    both = [s for s in by_id if {side[(s, uri)] for uri in hooks} == {"native", "runner"}]
    for story in both:
        bodies = {p["body"] for posts in posts_by_side.values() for p in posts
                  if p["story"] == story}  # fmt: skip
        assert len(bodies) == 1
    # The headers a receiver reads as the body's. (Not the User-Agent: worker.feedstory
    # reports the web tier's default, "<base-uri> Phorge/1.0 cURL/...", where Phorge's
    # worker under phd or the runner sends "Arcanist/1.0 cURL/...".)
    for header in ("Content-Type", "Accept", "Accept-Encoding"):
        values = {name: {p["headers"].get(header) for p in posts}
                  for name, posts in posts_by_side.items()}  # fmt: skip
        assert values["native"] == values["runner"] and len(values["native"]) == 1, values
    medians = {
        name: statistics.median(r["duration"] for i, r in hook_rows.items()
                                if label_of(r["leaseOwner"]) == name) / 1e6
        for name in ("native", "runner")
    }  # fmt: skip
    assert worker.running()
    print(f"\n{len(by_id)} stories x {len(hooks)} hooks: {Counter(side.values())}; "
          f"{len(both)} stories delivered by both sides; median run "
          f"{medians['native']:.3f} s native, {medians['runner']:.3f} s runner")  # fmt: skip

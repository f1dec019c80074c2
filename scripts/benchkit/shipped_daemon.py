"""The shipped ``PhorgeBridgeQueueDaemon`` next to Phorge's ``bin/phd debug taskmaster``
on the no-op PHP class, in one run: tasks/s of each (issue 28: at least as fast).

    cd scripts && PHORGE_ROOT=/path/to/phorge python3 -m benchkit.shipped_daemon [--tasks 2000]

The bench's set-up (``benchkit.phorge``: a private durable MariaDB, a copy of the checkout
with the extension and the no-op class) and measure (``Runner``: one batch, timed from its
COMMIT to the last archive); each round, in turn: Phorge's taskmaster, the shipped daemon
with every class phd's (``"*": 0``: no condition), then with only the class named.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from benchkit import mariadb, phorge, phorgedb, procs
from benchkit.cli import log
from benchkit.consumers import Phd
from benchkit.plan import PHP_NOOP
from benchkit.runner import Runner

SHIPPED = "PhorgeBridgeQueueDaemon"
CONSUMERS = {  # label: (daemon, phorge-bridge.canary); "taskmaster" alone names both now
    "phd debug taskmaster": ("PhabricatorTaskmasterDaemon", None),
    f"{SHIPPED}, all phd's": (SHIPPED, {"*": {"celery": 0}}),
    f"{SHIPPED}, class named": (SHIPPED, {phorge.NOOP_CLASS: {"celery": 0}}),
}


@dataclass
class Daemon(Phd):
    daemon: str = SHIPPED

    def start(self) -> None:
        assert self.root
        self.stop_signal = signal.SIGKILL  # Phorge's CLI ignores SIGTERM
        logs, command = Path(tempfile.mkdtemp(dir=self.scratch)), ["php", "bin/phd", "debug"]
        self.roles["workers"] = [
            procs.start(f"phd-{n}", [*command, self.daemon], env=self.env, cwd=self.root,
                        log=logs / f"phd-{n}.log") for n in range(self.processes)
        ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("tasks", 2000), ("rounds", 2), ("processes", 1), ("port", 3319)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args, rates, failed = parser.parse_args(), {label: [] for label in CONSUMERS}, False
    with ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bridge-bench-")))
        server = stack.enter_context(mariadb.private_server(args.port, scratch))
        conn = server.connect()
        stack.callback(conn.close)
        setup = (Path(os.environ["PHORGE_ROOT"]), server, conn, scratch, log, phorge.WEB_PORT)
        php = stack.enter_context(phorge.prepare(stack.enter_context(phorge.install(*setup)), log))
        conn.select_db(phorgedb.DATABASE)
        runner = Runner(conn, server.proc.pid)
        for _ in range(args.rounds):
            for label, (daemon, weights) in CONSUMERS.items():
                if weights is not None:
                    command = ["php", "bin/config", "set", "--database", "phorge-bridge.canary"]
                    phorge.run([*command, json.dumps(weights)], "bin/config", env=php.env,
                               cwd=php.root)  # fmt: skip
                phorgedb.truncate(conn)
                consumer = Daemon(label, scratch, root=php.root, env=php.env,
                                  processes=args.processes, daemon=daemon)  # fmt: skip
                try:
                    consumer.start()
                    runner.warm_up(consumer, PHP_NOOP, 32)
                    t = runner.throughput(consumer, PHP_NOOP, args.tasks)
                finally:
                    consumer.stop()
                rates[label].append(f"{t.rate:,.0f}")
                failed = failed or bool(t.problems)
                statements, cpu = t.server.get("Questions", 0), t.cpu.get("workers", 0.0)
                log(f"{label}: {t.rate:,.0f} tasks/s; a task: {statements / t.tasks:.1f} "
                    f"statements, {cpu / t.tasks * 1e3:.2f} ms CPU {t.problems or ''}")  # fmt: skip
    print(f"| {args.tasks} no-op tasks, x{args.processes} | tasks/s, each round |\n|---|---|")
    print("\n".join(f"| {label} | {', '.join(found)} |" for label, found in rates.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

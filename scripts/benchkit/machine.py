"""What the figures were measured on: the machine, the servers, the library versions."""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import MySQLdb

PACKAGES = ("celery", "kombu", "SQLAlchemy", "mysqlclient", "amqp", "billiard")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def memory_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 1024 / 1024
    return float("nan")


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def rabbitmq_version() -> str:
    """The broker's own answer (AMQP server properties)."""
    try:
        import amqp

        with amqp.Connection("127.0.0.1:5672", connect_timeout=3) as conn:
            return str(conn.server_properties.get("version", "unknown"))
    except Exception as exc:
        return f"unknown ({exc})"


def git_revision(repo: Path) -> str:
    """The bridge's commit, and whether the working tree differs from it."""
    done = subprocess.run(
        ["git", "-C", str(repo), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() or "unknown"


def describe(conn: MySQLdb.Connection, repo: Path) -> dict[str, str]:
    """Name and value of every fact the report's machine table shows."""
    cur = conn.cursor()
    cur.execute("SELECT VERSION()")
    mariadb = str(cur.fetchone()[0])
    facts = {
        "CPU": cpu_model(),
        "cores": str(os.cpu_count()),
        "RAM": f"{memory_gib():.1f} GiB",
        "kernel": platform.release(),
        "Python": platform.python_version(),
        "MariaDB": mariadb,
        "RabbitMQ": rabbitmq_version(),
    }
    facts.update({name: package_version(name) for name in PACKAGES})
    facts["phorge-bridge"] = git_revision(repo)
    facts["date"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return facts

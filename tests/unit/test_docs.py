"""The README's settings table is the one ``bridge/config.py`` generates."""

from __future__ import annotations

from pathlib import Path

from bridge.config import explain

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_settings_table_is_generated_from_the_code():
    readme = (ROOT / "README.md").read_text()
    assert explain() in readme, "paste `phorge-bridge settings --table` into the README"

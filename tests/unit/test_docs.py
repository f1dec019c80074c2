"""docs/settings.md's settings table is the one ``bridge/config.py`` generates."""

from __future__ import annotations

from pathlib import Path

from bridge.config import explain

ROOT = Path(__file__).resolve().parents[2]


def test_the_settings_table_is_generated_from_the_code():
    settings = (ROOT / "docs" / "settings.md").read_text()
    assert explain() in settings, "paste `phorge-bridge settings --table` into docs/settings.md"

"""The README's settings table stays true to bridge/config.py."""

from __future__ import annotations

import re
from pathlib import Path

from bridge.config import SETTINGS

ROOT = Path(__file__).resolve().parents[2]


def readme_settings() -> dict[str, str]:
    rows = re.findall(
        r"^\| `(BRIDGE_[A-Z_]+)` \| ([^|]*) \|", (ROOT / "README.md").read_text(), re.M
    )
    return {name: default.strip() for name, default in rows}


def test_every_setting_is_in_the_readme_table_with_its_default():
    table = readme_settings()
    assert sorted(table) == sorted(s.name for s in SETTINGS)
    for setting in SETTINGS:
        shown = table[setting.name]
        if setting.default:
            assert shown == f"`{setting.default}`", setting.name
        else:
            assert shown.startswith("("), setting.name

"""The README's settings table states each setting's default as app/settings.py has it (it said MAX_TOKENS was 512
while the default is 4096 on a CPU). Rows with numbers are checked, "a / b" rows value by value, "10 MiB" in bytes."""
from __future__ import annotations

import json
import re
from pathlib import Path

from app.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| (`ATTNLAB_[A-Z0-9_]+`(?: / `ATTNLAB_[A-Z0-9_]+`)*) \| ([^|]+) \|")


def _value(text: str):
    text = text.strip().strip("`")
    unit = re.fullmatch(r"([\d.]+) (KiB|MiB|GiB)", text)
    if unit:
        return float(unit[1]) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit[2]]
    try:
        return json.loads(text)
    except ValueError:
        return text


def test_readme_settings_table_matches_the_defaults():
    rows = [ROW.match(line) for line in (ROOT / "README.md").read_text().splitlines()]
    checked, wrong = 0, []
    for row in filter(None, rows):
        names = re.findall(r"ATTNLAB_([A-Z0-9_]+)", row[1])
        values = [_value(v) for v in row[2].split(" / ")] if len(names) > 1 else [_value(row[2])]
        for name, stated in zip(names, values):
            field = Settings.model_fields.get(name.lower())
            if field is None or not isinstance(stated, (int, float)) or isinstance(stated, bool):
                continue
            checked += 1
            if float(field.default) != float(stated):
                wrong.append((name, stated, field.default))
    assert checked >= 8
    assert not wrong, f"README settings table vs app/settings.py (name, README, default): {wrong}"

"""tools/dev/mutation_check.py cannot go stale unseen: every plant's text is in its file, once."""

from __future__ import annotations

from pathlib import Path

import pytest

from .tools_loader import load_tool

pytestmark = pytest.mark.fast  # torch-free: make test-fast
ROOT = Path(__file__).resolve().parent.parent


def test_every_plant_still_matches_the_code():
    mc = load_tool("mutation_check")
    assert len(mc.PLANTS) > 50
    assert set(mc.FAST) <= set(mc.PLANTS)
    assert mc.stale(ROOT) == []


def test_a_stale_plant_is_reported(monkeypatch):
    mc = load_tool("mutation_check")
    monkeypatch.setitem(mc.PLANTS, "no such text", ("runtime/sampling.py", "this text is not in the file", "x"))
    assert any("no such text" in s and "0 times" in s for s in mc.stale(ROOT))

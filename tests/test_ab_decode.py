"""tools/dev/ab_decode.py: two decoders alternated prompt by prompt, on the tiny bundles."""

from __future__ import annotations

import pytest

from specedge.runtime import SamplingParams

from .tools_loader import load_tool


def _tool():
    return load_tool("ab_decode")


def test_two_bundles_of_one_target_alternate_and_give_the_same_text(decoders):
    """The full draft head (A) and half of it (B): every prompt on both, the order swapped per prompt; one target,
    so greedy outputs are identical; the accepted/drafted counts and the per-prompt ratios are reported."""
    t = _tool()
    lines = []
    requests = [("p0", "the cat sat on the mat", False), ("p1", "one two three four", False)]
    res = t.ab([decoders["model"], decoders["model-head"]], requests, [("model", 4), ("none", 0)], 2,
               SamplingParams(max_new_tokens=12), say=lines.append)
    assert len(lines) == 2 * 2 * 2 and not any("differ" in s for s in lines)
    a, b, same, pairs = res[("model", 4)]
    assert len(a.speeds) == len(b.speeds) == 4 and same == [4] and pairs == [4]
    assert a.drafted > 0 and b.drafted > 0 and res[("none", 0)][0].drafted == 0
    table = t.summary(res)
    assert table[2].startswith("| model:4 |") and "4/4 |" in table[2] and table[3].startswith("| none:0 |")


def test_bad_arguments_are_refused_with_what_is_allowed():
    t = _tool()
    with pytest.raises(SystemExit, match="DRAFTER:K"):
        t.parse_spec("model")
    with pytest.raises(SystemExit, match="at least one"):
        t.parse_spec("")
    with pytest.raises(SystemExit):  # one bundle and no libraries: nothing to compare
        t.main(["only-one-bundle"])
    with pytest.raises(SystemExit, match="no such file"):
        t.load("any", "/nonexistent/lib.so")

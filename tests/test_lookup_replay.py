"""tools/lookup_replay.py: the replay follows the decoder's round rules, and its bound is a bound."""

from __future__ import annotations

import numpy as np
import pytest

from specedge.runtime.adaptive import AutoDrafter
from specedge.runtime.drafters import NoDrafter, PromptLookupDrafter

from .tools_loader import load_tool

STEPS = {2: 0.040, 4: 0.060, 6: 0.080, 10: 0.115}  # an int4-like CPU target: plain rounds at width 2
K = 9


def load():
    return load_tool("lookup_replay")


def sequences():
    rng = np.random.default_rng(3)
    fresh = rng.permutation(1000)[:120].tolist()  # no token repeats: nothing to look up, no guess passes
    text = rng.permutation(500)[:60].tolist()
    copy = text + [999] + text[:50] + list(range(500, 530))  # a copy of the context, then new text
    return {"fresh": (fresh, 20), "copy": (copy, 61)}


def test_plain_replay_is_one_width_2_step_per_token_without_repeats():
    lr = load()
    seq, P = sequences()["fresh"]
    t, rounds = lr.replay(lambda c: NoDrafter(), seq, P, STEPS, K, 3)
    assert rounds == len(seq) - P - 1 and t == pytest.approx(rounds * STEPS[2])


def test_lookup_replay_commits_a_copied_span_in_few_rounds():
    lr = load()
    seq, P = sequences()["copy"]
    t_plain, r_plain = lr.replay(lambda c: NoDrafter(), seq, P, STEPS, K, 3)
    t_look, r_look = lr.replay(lambda c: lr._Fixed(PromptLookupDrafter(3, 2), 8), seq, P, STEPS, K, 3)
    assert r_look < 0.7 * r_plain and t_look < 0.9 * t_plain  # 9 tokens a round through the copy, 2 in plain


@pytest.mark.parametrize("name", ["fresh", "copy"])
def test_bound_is_no_slower_than_any_replayed_lookup_policy(name):
    lr = load()
    seq, P = sequences()[name]
    best = lr.bound(seq, P, STEPS, K, 3, 2)
    policies = [lambda c: NoDrafter(), lambda c: AutoDrafter(c, PromptLookupDrafter(3, 2), None)]
    policies += [(lambda k: lambda c: lr._Fixed(PromptLookupDrafter(3, 2), k))(k) for k in (2, 4, 8)]
    times = [lr.replay(p, seq, P, STEPS, K, 3)[0] for p in policies]
    assert best <= min(times) + 1e-12
    if name == "fresh":  # nothing to gain: the bound is plain decoding
        assert best == pytest.approx(times[0])
    else:
        assert best < 0.85 * times[0]


def test_bound_on_a_sequence_worked_by_hand():
    """Prompt 10..17 99, the prefill gives 10; output 11 12 13 14 15 50 51 52. Plain rounds (width 2) cost 1,
    widths 3-4 1.5, 5-6 2. n=10: the guess 11 passes (1 -> n=12). n=12 (... 10 11 12): lookup proposes 13..17, 3
    pass: 3 tokens at width 4 (1.5 -> n=16) beat plain rounds whose guesses pass (13, then 15: 2 -> n=16).
    n=16, 17: new tokens, plain (2). Best 1 + 1.5 + 2 = 4.5; plain 5; a bound that assumed drafts pass: 3."""
    lr = load()
    seq = [10, 11, 12, 13, 14, 15, 16, 17, 99, 10, 11, 12, 13, 14, 15, 50, 51, 52]
    steps = {2: 1.0, 4: 1.5, 6: 2.0, 10: 3.0}
    assert lr.bound(seq, 9, steps, K, 3, 2) == pytest.approx(4.5)
    assert lr.replay(lambda c: NoDrafter(), seq, 9, steps, K, 3) == (pytest.approx(5.0), 5)

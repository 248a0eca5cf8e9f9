"""Tests with power: drafts of controlled acceptance, every position and a joint checked, each statistical test
with negative controls (planted bugs as alternative rules), plus direct checks of drafter state.

A draft q_i = (1 - eps) p_i + eps * noise_i accepts ~30-90 % of its tokens, so every number of accepted tokens
0..k (and with it every position's rejection branch and the bonus row) occurs thousands of times.
``tools/dev/mutation_check.py`` plants the same bugs in the real code and checks that this suite catches each."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from specedge.runtime.drafters import DraftCache, ModelDrafter, PromptLookupDrafter
from specedge.runtime.sampling import SamplingParams, residual, sample, verify_sampled

pytestmark = pytest.mark.fast  # torch-free: make test-fast

K, V, N = 4, 6, 30_000


def setup(eps: float, seed: int = 0):
    """Targets p_i and drafts q_i for positions 0..K (independent across positions, so the emitted sequence
    must have the product distribution p_0 x ... x p_K)."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(V) * 0.8, size=K + 1)  # [K+1, V]
    noise = rng.dirichlet(np.ones(V) * 0.5, size=K + 1)
    q = (1 - eps) * p + eps * noise  # [K+1, V]
    return p, q


def run_sequences(rule, p, q, n=N, seed=1):
    """n sequences of K+1 tokens, each made by rounds as the decoder makes them: a round at position pos drafts
    k = min(K, K - pos) tokens from q[pos..], verifies them against p[pos..pos+k] (the last row is the bonus),
    emits m + 1 tokens and the next round starts after them. Returns the sequences and, for the first round of
    each, how many draft tokens were accepted."""
    rng = np.random.default_rng(seed)
    seqs, first = [], np.zeros(K + 1, dtype=int)
    for _ in range(n):
        seq: list[int] = []
        while len(seq) < K + 1:
            pos = len(seq)
            k = min(K, K - pos)
            d = np.array([sample(q[pos + i], rng) for i in range(k)], dtype=np.int64)
            m, nxt = rule(p[pos: pos + k + 1], q[pos: pos + k], d, rng)
            if pos == 0:
                first[m] += 1
            seq += [*d[:m].tolist(), nxt]
        seqs.append(seq)
    return seqs, first


def position_pvalues(seqs, p) -> list[float]:
    """Chi-square p-value per position i of the emitted token vs p_i, and of the joint of positions 0 and 1
    vs p_0 x p_1."""
    arr = np.array(seqs)
    pv = [chisquare(np.bincount(arr[:, i], minlength=V), p[i] * len(arr)).pvalue for i in range(K + 1)]
    joint = np.outer(p[0], p[1]).ravel()
    pv.append(chisquare(np.bincount(arr[:, 0] * V + arr[:, 1], minlength=V * V), joint * len(arr)).pvalue)
    return pv


# -- planted bugs, as rules (negative controls) -------------------------------------------------------------
def bug_sample_p_at_rejection(p, q, d, rng):
    for i in range(len(d)):
        if rng.random() * q[i, d[i]] >= p[i, d[i]]:
            return i, sample(p[i], rng)
    return len(d), sample(p[len(d)], rng)


def bug_every_position_against_row0(p, q, d, rng):
    for i in range(len(d)):
        if rng.random() * q[i, d[i]] >= p[0, d[i]]:
            return i, sample(residual(p[0], q[i]), rng)
    return len(d), sample(p[len(d)], rng)


def bug_bonus_from_wrong_row(p, q, d, rng):
    m, nxt = verify_sampled(p, q, d, rng)
    return (m, sample(p[m - 1], rng)) if m == len(d) else (m, nxt)


@pytest.mark.parametrize("eps", [0.3, 0.7])
def test_every_position_and_a_joint_follow_the_target(eps):
    p, q = setup(eps)
    seqs, first = run_sequences(verify_sampled, p, q)
    rate = (first * np.arange(K + 1)).sum() / (K * N)
    assert 0.3 < rate < 0.9, rate  # controlled acceptance
    assert (first > 300).all(), first  # every m = 0..K occurs: every rejection position and the bonus row
    pv = position_pvalues(seqs, p)
    assert min(pv) > 1e-3 / len(pv), pv  # Bonferroni over K+1 positions and the joint


@pytest.mark.parametrize("bug", [bug_sample_p_at_rejection, bug_every_position_against_row0, bug_bonus_from_wrong_row])
def test_negative_controls_are_rejected(bug):
    p, q = setup(0.7)
    pv = position_pvalues(run_sequences(bug, p, q)[0], p)
    assert min(pv) < 1e-3 / len(pv), (bug.__name__, pv)


def test_model_drafter_rolls_its_cache_back_and_returns_q():
    """After k drafted tokens and m accepted, the draft cache keeps rows for the last committed token and
    d_1..d_min(m, k-1); sampled drafts carry their distributions q."""

    class FakeRunner:
        entry = type("E", (), {"widths": ()})()
        max_context, pads_into_cache, min_width = 64, False, 1

        def step(self, tokens, past_len, all_logits):  # noqa: ANN001
            return np.tile(np.linspace(0, 1, V), (len(tokens) if all_logits else 1, 1))

    d = ModelDrafter(DraftCache(FakeRunner()), V, prefill_chunk=8)
    params = SamplingParams(temperature=1.0, seed=3)
    tokens = np.arange(10) % V
    for m in range(0, 5):
        d.reset()
        prop = d.propose(tokens, 4, params, np.random.default_rng(0))
        assert prop.q_draft is not None and prop.q_draft.shape == (4, V)
        assert np.allclose(prop.q_draft.sum(-1), 1)
        d.commit(m)
        assert d.rows == len(tokens) + min(m, 3), (m, d.rows)


def test_prompt_lookup_proposes_what_followed_the_match():
    d = PromptLookupDrafter(3, 1)
    tokens = np.array([5, 1, 2, 3, 4, 9, 1, 2, 3])
    prop = d.propose(tokens, 3, SamplingParams(), np.random.default_rng(0))
    assert prop.tokens.tolist() == [4, 9, 1]  # after the earlier "1 2 3": 4, 9, then 1
    assert d.propose(np.array([7, 8]), 2, SamplingParams(), np.random.default_rng(0)).tokens.tolist() == []


def _lookup_by_each_length(tokens, k, ngram_max, ngram_min):
    """The matcher as it was written before (one window search per n-gram length, longest first): the reference."""
    n_tok = len(tokens)
    for n in range(min(ngram_max, n_tok - 1), ngram_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: n_tok - 1], n)
        hits = np.flatnonzero((windows == tokens[n_tok - n:]).all(axis=1))
        if len(hits):
            return tokens[int(hits[-1]) + n: int(hits[-1]) + n + k].tolist()
    return []


@pytest.mark.parametrize("ngram_max,ngram_min", [(3, 1), (3, 2), (8, 1), (32, 2), (64, 1)])
def test_prompt_lookup_takes_the_occurrence_agreeing_with_the_longest_context(ngram_max, ngram_min):
    """The matcher extends all matches of the last ngram_min tokens backwards at once; it must pick what a search
    per length (ngram_max down to ngram_min, the most recent match of the longest) picks, on repetitive token
    streams (small alphabets: many matches, long agreements) of every length."""
    rng = np.random.default_rng(ngram_max * 10 + ngram_min)
    d = PromptLookupDrafter(ngram_max, ngram_min)
    for trial in range(300):
        alphabet = int(rng.integers(2, 6))
        base = rng.integers(0, alphabet, size=int(rng.integers(1, 40)))
        tokens = np.concatenate([base, base[: int(rng.integers(0, len(base) + 1))], rng.integers(0, alphabet, size=3)])
        tokens = tokens[: int(rng.integers(1, len(tokens) + 1))]
        k = int(rng.integers(1, 9))
        got = d.propose(tokens, k, SamplingParams(), rng).tokens.tolist()
        assert got == _lookup_by_each_length(tokens, k, ngram_max, ngram_min), (trial, tokens.tolist(), k)


def test_a_longer_context_picks_the_occurrence_that_continues_the_text():
    """Two earlier occurrences of "1 2 3": the most recent one is followed by 7, the one whose preceding tokens
    (4 5 6 ...) agree with the context's is followed by 8. A 3-token match takes the most recent; a longer
    one, the occurrence the text is copying."""
    tokens = np.array([4, 5, 6, 1, 2, 3, 8, 0, 9, 1, 2, 3, 7, 0, 4, 5, 6, 1, 2, 3])
    params, rng = SamplingParams(), np.random.default_rng(0)
    assert PromptLookupDrafter(3, 2).propose(tokens, 1, params, rng).tokens.tolist() == [7]
    assert PromptLookupDrafter(32, 2).propose(tokens, 1, params, rng).tokens.tolist() == [8]


def test_a_new_model_drafter_keeps_the_draft_rows_that_agree():
    class FakeRunner:
        entry = type("E", (), {"widths": ()})()
        max_context, pads_into_cache, min_width = 64, False, 1
        fed = 0

        def step(self, tokens, past_len, all_logits):  # noqa: ANN001
            FakeRunner.fed += len(tokens)
            return np.zeros((len(tokens) if all_logits else 1, V))

    cache = DraftCache(FakeRunner())  # one cache, three drafters in turn
    first = ModelDrafter(cache, V, prefill_chunk=8)
    a = np.arange(12) % V
    first.propose(a, 2, SamplingParams(), np.random.default_rng(0))
    second = ModelDrafter(cache, V, prefill_chunk=8)  # the next request, whose prompt extends the first's tokens
    b = np.concatenate([a, [1, 2, 3]])
    second._adopt(b)
    assert second.rows == len(a) - 1
    third = ModelDrafter(cache, V, prefill_chunk=8)
    c = b.copy()
    c[4] = (c[4] + 1) % V  # differs at position 4
    third._adopt(c)
    assert third.rows == 4


def test_a_partial_draft_head_proposes_token_ids_and_keeps_the_target_distribution():
    """A draft head over some ids (HeadRows): logits column j is token head_ids[j] (columns past the target's
    vocabulary dropped); greedy proposes that id, sampling's q is zero outside the head; and drafts from such a
    q, zero on half the vocabulary, still emit the target's distribution at every position."""
    head_ids = np.array([1, 3, 5, 7])  # 7 is past the target's V = 6

    class FakeRunner:
        entry = type("E", (), {"widths": ()})()
        max_context, pads_into_cache, min_width = 64, False, 1

        def step(self, tokens, past_len, all_logits):  # noqa: ANN001
            return np.tile(np.array([0.0, 1.0, 3.0, 9.0]), (len(tokens) if all_logits else 1, 1))

    d = ModelDrafter(DraftCache(FakeRunner()), V, prefill_chunk=8, head_ids=head_ids)
    tokens = np.arange(10) % V
    assert d.propose(tokens, 2, SamplingParams(), np.random.default_rng(0)).tokens.tolist() == [5, 5]
    d.reset()
    prop = d.propose(tokens, 2, SamplingParams(temperature=1.0, seed=3), np.random.default_rng(0))
    want = np.zeros(V)
    want[[1, 3, 5]] = np.exp([0.0, 1.0, 3.0]) / np.exp([0.0, 1.0, 3.0]).sum()
    np.testing.assert_allclose(prop.q_draft, np.tile(want, (2, 1)))
    assert set(prop.tokens.tolist()) <= {1, 3, 5}

    p, _ = setup(0.0)
    q = np.zeros_like(p)
    q[:, [1, 3, 5]] = p[:, [1, 3, 5]] / p[:, [1, 3, 5]].sum(-1, keepdims=True)  # the draft knows half the ids
    seqs, first = run_sequences(verify_sampled, p, q)
    assert 0.2 < (first * np.arange(K + 1)).sum() / (K * N) < 0.8
    pv = position_pvalues(seqs, p)
    assert min(pv) > 1e-3 / len(pv), pv
    assert np.bincount(np.array(seqs)[:, 0], minlength=V)[[0, 2, 4]].min() > 0.5 * N * p[0, [0, 2, 4]].min()

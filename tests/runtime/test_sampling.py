"""Exactness of the acceptance rule, proved on random small vocabularies."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specedge.runtime.errors import SamplingParamsError
from specedge.runtime.sampling import (
    SamplingParams,
    process_logits,
    residual,
    sample,
    verify_greedy,
    verify_sampled,
)

pytestmark = pytest.mark.fast  # torch-free: make test-fast

logits_st = st.integers(2, 12).flatmap(
    lambda v: st.lists(st.floats(-8, 8, allow_nan=False), min_size=v, max_size=v).map(np.array))


def _dist(v: int, rng: np.random.Generator, n: int = 1) -> np.ndarray:
    return process_logits(rng.normal(0, 2, (n, v)), 1.0)


@settings(max_examples=60, deadline=None)
@given(logits_st, st.integers(0, 2**31 - 1))
def test_p_equal_q_accepts_everything(logits, seed):
    rng = np.random.default_rng(seed)
    p = process_logits(np.tile(logits, (4, 1)), 1.0)  # [n+1=4, V]
    drafts = np.array([sample(p[i], rng) for i in range(3)])
    m, _ = verify_sampled(p, p[:3], drafts, rng)
    assert m == 3


@settings(max_examples=60, deadline=None)
@given(logits_st, logits_st, st.integers(0, 2**31 - 1))
def test_residual_is_a_distribution(a, b, seed):
    v = min(len(a), len(b))
    p, q = process_logits(a[None, :v], 1.0)[0], process_logits(b[None, :v], 1.0)[0]
    r = residual(p, q)
    assert (r >= 0).all() and abs(r.sum() - 1) < 1e-9


@settings(max_examples=40, deadline=None)
@given(logits_st, st.integers(0, 2**31 - 1))
def test_k0_is_plain_sampling(logits, seed):
    p = process_logits(logits[None], 1.0)
    a = verify_sampled(p, None, np.zeros(0, dtype=np.int64), np.random.default_rng(seed))
    assert a == (0, sample(p[0], np.random.default_rng(seed)))


@settings(max_examples=40, deadline=None)
@given(logits_st, st.integers(1, 12), st.floats(0.05, 1.0))
def test_top_k_top_p_filters(logits, k, top_p):
    probs = process_logits(logits[None], 0.7, top_k=k, top_p=top_p)[0]
    assert abs(probs.sum() - 1) < 1e-9
    assert (probs > 0).sum() <= max(k, (logits == np.sort(logits)[-min(k, len(logits))]).sum() + k)
    top = np.flatnonzero(logits >= logits.max() - 1e-9)
    assert probs[top].sum() > 0  # a most likely token always survives


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = process_logits(np.log(np.array([[0.5, 0.3, 0.15, 0.05]])), 1.0, top_p=0.7)
    assert np.allclose(probs, [[0.5 / 0.8, 0.3 / 0.8, 0, 0]])
    probs = process_logits(np.log(np.array([[0.5, 0.3, 0.15, 0.05]])), 1.0, top_p=0.4)
    assert np.allclose(probs, [[1, 0, 0, 0]])


def test_greedy_accepts_while_argmax():
    logits = np.eye(5)[[1, 2, 3, 4]] * 10  # argmax rows: 1, 2, 3, 4
    assert verify_greedy(logits, np.array([1, 2, 3])) == (3, 4)
    assert verify_greedy(logits, np.array([1, 0, 3])) == (1, 2)
    assert verify_greedy(logits[:1], np.array([], dtype=np.int64)) == (0, 1)


def wrong_rule(p_target, q_draft, draft_tokens, rng):
    """Negative control: at rejection sample from p instead of norm(max(0, p - q))."""
    for i, d in enumerate(draft_tokens):
        if rng.random() * q_draft[i, d] < p_target[i, d]:
            continue
        return i, sample(p_target[i], rng)
    return len(draft_tokens), sample(p_target[len(draft_tokens)], rng)


def _first_token_histogram(rule, p, q, n, rng):
    """Emit the first token of a speculative round (draft 1 token from q) n times."""
    v = p.shape[1]
    counts = np.zeros(v)
    cdf_q = np.cumsum(q[0])
    for _ in range(n):
        d = min(int(np.searchsorted(cdf_q, rng.random() * cdf_q[-1], side="right")), v - 1)
        m, nxt = rule(p, q, np.array([d]), rng)
        counts[d if m >= 1 else nxt] += 1
    return counts


@pytest.mark.parametrize("top_k, top_p, temperature", [(0, 1.0, 1.0), (4, 1.0, 0.8), (0, 0.8, 1.3), (5, 0.9, 0.6)])
def test_emitted_marginal_equals_target_chi_square(top_k, top_p, temperature):
    """>= 100k draws, alpha = 0.001; the same test rejects a deliberately wrong rule."""
    rng = np.random.default_rng(1234)
    v = 8
    raw_p, raw_q = rng.normal(0, 0.7, (2, v)), rng.normal(0, 0.7, (1, v))
    p = process_logits(raw_p, temperature, top_k, top_p)  # [2, V]: p_1 and bonus p_2
    q = process_logits(raw_q, temperature, top_k, top_p)  # [1, V]
    n = 100_000
    support = p[0] > 0
    assert support.sum() >= 3  # a non-degenerate case
    good = _first_token_histogram(verify_sampled, p, q, n, rng)
    assert good[~support].sum() == 0
    assert chisquare(good[support], p[0][support] * n).pvalue > 0.001
    bad = _first_token_histogram(wrong_rule, p, q, n, rng)
    assert chisquare(bad[support], p[0][support] * n).pvalue < 0.001


def test_one_hot_proposals_keep_the_distribution():
    rng = np.random.default_rng(7)
    p = _dist(6, rng, 2)
    n = 100_000
    counts = np.zeros(6)
    for _ in range(n):
        m, nxt = verify_sampled(p, None, np.array([2]), rng)  # prompt lookup always proposes token 2
        counts[2 if m else nxt] += 1
    assert chisquare(counts, p[0] * n).pvalue > 0.001


@pytest.mark.parametrize("kw", [{"max_new_tokens": 0}, {"temperature": -1}, {"top_k": -2}, {"top_p": 0},
                                {"top_p": 1.5}, {"stop": ("",)}])
def test_invalid_params_are_refused(kw):
    with pytest.raises(SamplingParamsError):
        SamplingParams(**kw)


def _keyed_counts(p: np.ndarray, n: int, draw) -> np.ndarray:  # noqa: ANN001
    counts = np.zeros(len(p))
    for i in range(n):
        counts[draw(p, i)] += 1
    return counts


def test_keyed_sampler_draws_from_p_and_a_wrong_race_is_caught():
    """Position-keyed draws over positions 0..n-1 (one seed) follow p (chi-square goodness of fit); the
    negative control — the same race with uniform instead of exponential noise — is rejected by the same test."""
    from scipy.stats import chisquare

    from specedge.runtime.sampling import keyed_exponentials, keyed_sample

    p = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    n = 6000
    good = _keyed_counts(p, n, lambda p, i: keyed_sample(p, 11, i))
    assert chisquare(good, p * n).pvalue > 1e-3
    wrong = _keyed_counts(p, n, lambda p, i: int(np.argmax(p / np.random.default_rng([11, i]).random(len(p)))))
    assert chisquare(wrong, p * n).pvalue < 1e-3
    # pure function of (probs, seed, position); another seed or position is other noise
    assert keyed_sample(p, 5, 17) == keyed_sample(p.copy(), 5, 17)
    assert not np.array_equal(keyed_exponentials(5, 17, 6), keyed_exponentials(5, 18, 6))
    assert not np.array_equal(keyed_exponentials(5, 17, 6), keyed_exponentials(6, 17, 6))


def test_keyed_verification_accepts_exactly_the_keyed_tokens():
    from specedge.runtime.sampling import keyed_sample, verify_keyed

    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(8) * 0.5, size=5)  # [n+1 = 5, V = 8]
    want = [keyed_sample(p[i], 3, 40 + i) for i in range(5)]
    assert verify_keyed(p, np.array(want[:4]), 3, 40) == (4, want[4])  # all accepted + bonus
    for j in range(4):  # a wrong token at j: j accepted, the keyed token emitted there
        d = np.array(want[:4])
        d[j] = (d[j] + 1) % 8
        assert verify_keyed(p, d, 3, 40) == (j, want[j])


def test_tiny_temperature_is_not_nan():
    from specedge.runtime.sampling import process_logits

    probs = process_logits(np.array([[1.0, 3.0, 2.0]]), 1e-310)
    assert np.array_equal(probs, [[0.0, 1.0, 0.0]])


# ---- every sampling parameter against a literal reference (not process_logits itself): ignoring one must fail
_LOGITS = np.array([2.0, 1.0, 0.0, -1.0])  # V = 4


def _softmax_literal(*logits: float) -> list[float]:
    e = [math.exp(x) for x in logits]
    return [x / sum(e) for x in e]


# p at T=1 is [0.644, 0.237, 0.087, 0.032]: the mass before each token is 0, 0.644, 0.881, 0.968
LITERAL = [
    ((1.0, 0, 1.0), _softmax_literal(2, 1, 0, -1)),
    ((0.5, 0, 1.0), _softmax_literal(4, 2, 0, -2)),  # temperature: logits / T
    ((2.0, 0, 1.0), _softmax_literal(1, 0.5, 0, -0.5)),
    ((1.0, 2, 1.0), _softmax_literal(2, 1) + [0.0, 0.0]),  # top-k 2
    ((1.0, 3, 1.0), _softmax_literal(2, 1, 0) + [0.0]),
    ((1.0, 0, 0.6), [1.0, 0.0, 0.0, 0.0]),  # top-p 0.6: the first token alone reaches it
    ((1.0, 0, 0.7), _softmax_literal(2, 1) + [0.0, 0.0]),  # 0.644 < 0.7: the second is kept too
    ((1.0, 0, 0.9), _softmax_literal(2, 1, 0) + [0.0]),
    ((0.5, 3, 0.99), _softmax_literal(4, 2, 0) + [0.0]),  # T, top-k and top-p together
]


@pytest.mark.parametrize("params, want", LITERAL, ids=[f"T{t}-k{k}-p{p}" for (t, k, p), _ in LITERAL])
def test_process_logits_matches_a_literal_distribution(params, want):
    temperature, top_k, top_p = params
    got = process_logits(_LOGITS[None], temperature, top_k, top_p)[0]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("params, want", [LITERAL[1], LITERAL[3], LITERAL[6], LITERAL[8]],
                         ids=["temperature", "top-k", "top-p", "all"])
@pytest.mark.parametrize("sampler", ["classic", "keyed"])
def test_the_plain_sampling_path_draws_the_literal_distribution(params, want, sampler):
    """choose_next (what a plain round and every emitted token go through) against the literal distribution:
    chi-square over 20k draws, and no draw outside the kept tokens."""
    from specedge.runtime.sampling import choose_next

    temperature, top_k, top_p = params
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=5, sampler=sampler)
    rng = np.random.default_rng(3)
    n = 20_000
    counts = np.bincount([choose_next(_LOGITS, sp, rng, position=i) for i in range(n)], minlength=4)
    want = np.array(want)
    assert counts[want == 0].sum() == 0
    assert chisquare(counts[want > 0], want[want > 0] * n).pvalue > 1e-3


def test_the_seed_fixes_the_keyed_draws_and_another_seed_changes_them():
    from specedge.runtime.sampling import choose_next

    def draws(seed):
        sp = SamplingParams(temperature=1.0, seed=seed)
        return [choose_next(_LOGITS, sp, np.random.default_rng(seed + 100), position=i) for i in range(200)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)

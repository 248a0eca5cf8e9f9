"""End to end on tiny exported models: exactness, stops, errors, threads."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from specedge.runtime import (
    BundleError,
    ContextLengthError,
    OptionError,
    PromptError,
    SamplingParams,
    SamplingParamsError,
    SpecDecoder,
)
from specedge.runtime.drafters import feed

PROMPTS = ["def fib(n):", "The quick brown fox", "import numpy as np\nx = np.arange(10)\n"]
NEAR_TIE = 1e-4


def greedy_mismatch(dec: SpecDecoder, prompt: str, spec: list[int], plain: list[int], tie: float = NEAR_TIE) -> int:
    """0 if identical; 1 if the first difference is a numerical near-tie (top-2 gap < tie); fails otherwise."""
    if spec == plain:
        return 0
    i = next(j for j in range(min(len(spec), len(plain))) if spec[j] != plain[j])
    ids = dec.encode_prompt(prompt) + plain[:i]
    logits = feed(dec.target, np.array(ids), 0, dec.manifest.prefill_chunk)
    top2 = np.sort(logits)[-2:]
    gap = float(top2[1] - top2[0])
    assert gap < tie, f"greedy mismatch at token {i} with top-2 gap {gap:.2e} (not a near-tie)"
    return 1


@pytest.mark.parametrize("bundle, drafter", [("lookup", "prompt-lookup"), ("model", "model"), ("self", "model"),
                                             ("model", "auto"), ("model", "hybrid"), ("lookup", "auto"),
                                             ("self", "auto"), ("model-head", "model"), ("model-head", "auto")])
def test_speculative_greedy_equals_plain(decoders, bundle, drafter):
    """Strict: ONNX Runtime CPU steps are batch-invariant (no width-1 target step), so token for token."""
    dec = decoders[bundle]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        plain = dec.generate(prompt, params, drafter="none").token_ids
        assert len(plain) == 40
        for k in (1, 2, 4, 8):
            res = dec.generate(prompt, params, drafter=drafter, k=k)
            assert res.token_ids == plain, (prompt, drafter, k)
            assert res.stats.drafted >= res.stats.accepted
    if bundle == "self" and drafter == "model":  # the draft is the target itself: everything is accepted
        res = dec.generate(PROMPTS[0], params, drafter="model", k=4)
        assert res.stats.acceptance_rate > 0.95 and res.stats.accept_hist[-1] >= 7


@pytest.mark.parametrize("bundle, drafter", [("self", "model"), ("model", "model"), ("lookup", "prompt-lookup"),
                                             ("self", "hybrid")])
def test_max_new_and_eos_at_round_boundaries(decoders, bundle, drafter):
    dec = decoders[bundle]
    prompt = PROMPTS[0]
    plain = dec.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True), drafter="none").token_ids
    for n in range(1, 13):  # every remainder modulo k+1 for k = 4
        res = dec.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), drafter=drafter, k=4)
        assert res.token_ids == plain[:n] and res.finish_reason == "length"
    manifest = dec.manifest
    try:
        for j in (0, 3, 4, 5, 9):  # make the j-th generated token an eos
            tok = dataclasses.replace(manifest.tokenizer, eos_ids=(plain[j],))
            dec.manifest = dataclasses.replace(manifest, tokenizer=tok)
            res = dec.generate(prompt, SamplingParams(max_new_tokens=24), drafter=drafter, k=4)
            first = plain.index(plain[j])
            assert res.finish_reason == "eos" and res.token_ids == plain[:first]
    finally:
        dec.manifest = manifest


@pytest.mark.parametrize("bundle", ["model", "self", "lookup", "model-head"])
def test_a_seed_fixes_the_text_whatever_the_drafter(decoders, bundle):
    """Position-keyed sampling: plain, every drafter, every k and repeated auto requests give one text."""
    dec = decoders[bundle]
    drafters = (["prompt-lookup", "auto", "hybrid", "model"] if dec.draft_runner is not None
                else ["prompt-lookup", "auto"])
    for temperature, top_p in ((0.8, 1.0), (1.2, 0.9)):
        params = SamplingParams(max_new_tokens=32, temperature=temperature, top_p=top_p, seed=7, ignore_eos=True)
        plain = dec.generate(PROMPTS[0], params, drafter="none").token_ids
        for d in drafters:
            for k in (1, 3, 8):
                assert dec.generate(PROMPTS[0], params, drafter=d, k=k).token_ids == plain, (d, k)
        for _ in range(4):
            assert dec.generate(PROMPTS[0], params, drafter="auto").token_ids == plain
        other = dec.generate(PROMPTS[0], dataclasses.replace(params, seed=8), drafter="none").token_ids
        assert other != plain  # the seed matters (negative control)
    if bundle == "self":  # the draft is the target itself and shares the keyed noise: it is always right
        res = dec.generate(PROMPTS[0], params, drafter="model", k=4)
        assert res.stats.acceptance_rate > 0.95


@pytest.mark.parametrize("bundle, drafter, sampler", [("model", "model", "classic"), ("model", "hybrid", "classic"),
                                                      ("model", "model", "keyed"), ("model-head", "model", "classic")])
def test_sampled_tokens_follow_the_target_distribution(decoders, bundle, drafter, sampler):
    """First three generated tokens over many seeds: speculative (random draft, so many rejections)
    vs plain sampling, two-sample chi-square per position at alpha = 0.001. hybrid mixes prompt lookup,
    the draft model and early-stopped drafts round by round. model-head: a draft whose distribution is zero on
    half the vocabulary (its partial head), where the target puts about half its mass."""
    dec = decoders[bundle]
    params = dict(max_new_tokens=3, temperature=1.0, top_k=6, ignore_eos=True, sampler=sampler)
    n = 400
    spec = np.array([dec.generate("The", SamplingParams(seed=s, **params), drafter=drafter, k=2).token_ids
                     for s in range(n)])
    plain = np.array([dec.generate("The", SamplingParams(seed=10_000 + s, **{**params, "sampler": "classic"}),
                                   drafter="none").token_ids
                      for s in range(n)])
    for pos in range(3):
        vals = np.union1d(spec[:, pos], plain[:, pos])
        table = np.array([[np.sum(x[:, pos] == v) for v in vals] for x in (spec, plain)])
        table = table[:, table.sum(axis=0) >= 10]  # drop sparse cells; the test stays valid on the rest
        if table.shape[1] >= 2:
            assert chi2_contingency(table).pvalue > 0.001, f"position {pos}: {table}"


def test_bad_input_is_refused_and_decoder_stays_usable(decoders):
    dec = decoders["lookup"]
    with pytest.raises(PromptError):
        dec.generate("", SamplingParams())
    with pytest.raises(ContextLengthError, match=r"S_max=256, request needs .*prompt .* \+ max_new 250 \+ K\+1 9"):
        dec.generate("def fib(n):", SamplingParams(max_new_tokens=250))
    with pytest.raises(ContextLengthError):
        dec.generate("x " * 300, SamplingParams(max_new_tokens=4))
    with pytest.raises(SamplingParamsError, match="k must be an integer in 0..8"):
        dec.generate("hi", SamplingParams(), k=9)
    with pytest.raises(SamplingParamsError, match="no draft model"):
        dec.generate("hi", SamplingParams(), drafter="model")
    assert len(dec.generate("def fib(n):", SamplingParams(max_new_tokens=5, ignore_eos=True)).token_ids) == 5


def test_corrupt_bundle_is_refused_at_load(bundles, tmp_path):
    """The default load checks sizes and sampled blocks (no hashing of gigabytes before the first token on a Jetson):
    a truncated weight file is refused; a bit flip is caught by verify="sha256", and by the default where it falls in
    a sampled block (a file this small is sampled whole)."""
    import shutil

    dst = tmp_path / "b"
    shutil.copytree(bundles["lookup"], dst)
    raw = bytearray((dst / "target.onnx.data").read_bytes())
    raw[-5] ^= 1
    (dst / "target.onnx.data").write_bytes(bytes(raw))
    with pytest.raises(BundleError, match="sha256"):
        SpecDecoder.load(dst, verify="sha256")
    with pytest.raises(BundleError, match="sampled hash"):
        SpecDecoder.load(dst)
    SpecDecoder.load(dst, verify="none").close()
    (dst / "target.onnx.data").write_bytes(bytes(raw[:-64]))
    with pytest.raises(BundleError, match="bytes"):
        SpecDecoder.load(dst)


def test_stop_strings_and_streaming_text(decoders):
    dec = decoders["lookup"]
    full = dec.generate("def fib(n):", SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert full.text == dec.codec.decode(full.token_ids)
    stop = full.text[5:8]
    pieces = [ev.text for ev in dec.stream("def fib(n):", SamplingParams(max_new_tokens=30, stop=(stop,)))]
    text = "".join(pieces)
    assert stop not in text and text == full.text[: full.text.index(stop)]  # everything up to the stop, no more


@pytest.mark.parametrize("bundle, drafter", [("lookup", "prompt-lookup"), ("self", "model"), ("model", "auto")])
def test_stop_string_keeps_no_token_past_it_under_speculation(decoders, bundle, drafter):
    """token_ids and new_tokens end at the token that completed the stop string, as in plain decoding, even when
    one round accepted several tokens past it (the self-draft accepts everything)."""
    dec = decoders[bundle]
    prompt = "hello world hello world hello world"
    full = dec.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True), drafter="none")
    for stop in {full.text[3:6], full.text[10:12], full.text[-4:-2]}:
        params = SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(stop,))
        plain = dec.generate(prompt, params, drafter="none")
        spec = dec.generate(prompt, params, drafter=drafter, k=8)
        assert plain.finish_reason == spec.finish_reason == "stop"
        assert spec.token_ids == plain.token_ids and spec.text == plain.text, stop
        assert spec.stats.new_tokens == len(plain.token_ids)
        assert stop in dec.codec.decode(plain.token_ids) and stop not in dec.codec.decode(plain.token_ids[:-1])


def test_chat_messages_use_the_template(decoders):
    dec = decoders["lookup"]
    ids = dec.encode_prompt([{"role": "user", "content": "hello"}])
    assert dec.codec.decode(ids) == "user\nhello\nassistant\n"  # special tokens are skipped in decode
    assert ids[0] == dec.codec.tok.token_to_id("<|im_start|>")


def test_threads_are_serialized(decoders):
    dec = decoders["model"]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    want = {p: dec.generate(p, params).token_ids for p in PROMPTS}
    got: dict[str, list[int]] = {}

    def work(p):
        got[p] = dec.generate(p, params).token_ids

    threads = [threading.Thread(target=work, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


@pytest.mark.parametrize("bundle, drafter", [("model", "model"), ("model", "auto"), ("lookup", "prompt-lookup")])
def test_interleaved_streams_in_one_thread_are_all_served_exactly(decoders, bundle, drafter):
    """Two streams advanced alternately in one thread (an asyncio server's pattern): no deadlock, and each
    text equals its solo text (a resumed stream re-prefills its committed tokens)."""
    dec = decoders[bundle]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, seed=5)
    want = {p: dec.generate(p, params, drafter=drafter, k=3).token_ids for p in PROMPTS[:2]}
    streams = {p: dec.stream(p, params, drafter=drafter, k=3) for p in PROMPTS[:2]}
    got = {p: [] for p in streams}
    live = dict(streams)
    while live:
        for p in list(live):
            ev = next(live[p], None)
            if ev is None:
                del live[p]
            else:
                got[p] += ev.token_ids
    assert got == want


def test_a_paused_stream_blocks_no_other_thread(decoders):
    dec = decoders["lookup"]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    paused = dec.stream(PROMPTS[0], params)
    first = next(paused)  # started, then left paused (a slow client)
    done = []
    t = threading.Thread(target=lambda: done.append(dec.generate(PROMPTS[1], params).token_ids))
    t.start()
    t.join(timeout=60)
    assert done and len(done[0]) == 16, "another thread was blocked by a paused stream"
    rest = [tid for ev in paused for tid in ev.token_ids]  # the paused stream still finishes, exactly
    assert first.token_ids + rest == dec.generate(PROMPTS[0], params).token_ids
    abandoned = dec.stream(PROMPTS[2], params)
    next(abandoned)
    del abandoned  # never closed explicitly
    assert len(dec.generate(PROMPTS[1], params).token_ids) == 16


@pytest.mark.parametrize("bundle, drafter", [("lookup", "auto"), ("model", "model")])
def test_a_second_turn_reuses_the_cached_prefix_and_gives_the_same_text(decoders, bundle, drafter):
    dec = decoders[bundle]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    first = dec.generate(PROMPTS[0], params, drafter=drafter)
    follow = PROMPTS[0] + first.text + " and then"
    reused = dec.generate(follow, params, drafter=drafter)
    n_prompt = len(dec.encode_prompt(follow))
    assert reused.stats.reused_tokens >= len(dec.encode_prompt(PROMPTS[0])) - 1
    assert reused.stats.reused_tokens < n_prompt
    fresh = dec.generate(follow, params, drafter=drafter, reuse_prefix=False)
    assert fresh.stats.reused_tokens == 0 and reused.token_ids == fresh.token_ids
    again = dec.generate(follow, params, drafter=drafter)  # the same prompt again: all but its last token
    assert again.stats.reused_tokens == n_prompt - 1 and again.token_ids == fresh.token_ids


def test_a_request_that_reuses_nothing_finds_the_draft_cold_too(decoders):
    """reuse_prefix=False is a new request's cost for the draft as well: run after model:4 on the same prompt, a
    benchmark's next configuration found the draft caught up on the prompt (auto measured against a model:k that had
    paid that catch-up in its first round)."""
    dec = decoders["model"]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    dec.generate(PROMPTS[0], params, drafter="model")
    model = dec.make_drafter("model")
    n = len(dec.encode_prompt(PROMPTS[0]))
    ids = np.asarray(dec.encode_prompt(PROMPTS[0]) + [1])
    assert model.catchup_plan(n + 1, ids) == []  # the draft holds the prompt already
    stream = dec.stream(PROMPTS[0], params, drafter="model", reuse_prefix=False)
    next(stream)  # the prefill, before any round
    assert sum(model.catchup_plan(n + 1, ids)) == n + 1  # everything
    stream.close()


def test_lookup_drafts_need_a_two_token_match_while_the_free_guess_takes_any(decoders):
    """A one-token match is a weak guess: as a multi-token draft it widens the verify step for little (measured:
    fixed-k lookup on Qwen at 0.73-0.88x plain with 1-gram drafts, 0.95-1.05x without; docs/benchmarks.md), but
    as the free guess in the width-2 step that runs anyway it costs nothing."""
    from specedge.runtime.manifest import DEFAULT_NGRAM_MIN

    assert DEFAULT_NGRAM_MIN == 2
    for dec in (decoders["model"], decoders["lookup"]):
        dp = dec.manifest.drafter_params
        lookup = dec.make_drafter("prompt-lookup")
        assert lookup.ngram_min == dp.get("ngram_min", DEFAULT_NGRAM_MIN) == 2
        assert dec._guesser.ngram_min == 1
    tokens = np.array([5, 6, 7, 9, 8, 7])  # the suffix 7 occurred before (then 9); "8 7" never did
    params = SamplingParams()
    assert len(decoders["lookup"].make_drafter("prompt-lookup").propose(tokens, 4, params, None).tokens) == 0
    assert decoders["lookup"]._guesser.propose(tokens, 1, params, None).tokens.tolist() == [9]


@pytest.mark.parametrize("n", [1, 2, 5, 17, 40])
def test_feed_runs_its_plan_and_the_draft_prices_its_catch_up_by_it(decoders, n):
    """feed() steps through feed_plan() exactly, so the catch-up that auto prices (ModelDrafter.catchup_plan) is the
    one the draft then runs: the tokens it has not seen and, riding in the same steps, the first draw's."""
    from specedge.runtime.drafters import ModelDrafter, feed_plan

    dec = decoders["model"]
    runner = dec.draft_runner
    P = dec.manifest.prefill_chunk
    ran, step = [], runner.step

    def recording(ids, past_len, all_logits=False, **kw):
        ran.append((len(ids), all_logits))
        return step(ids, past_len, all_logits=all_logits, **kw)

    runner.step = recording
    try:
        ids = np.arange(3, 3 + n, dtype=np.int64)
        feed(runner, ids, 0, P)
        assert ran == feed_plan(runner, n, 0, P) and sum(t for t, _ in ran) == n
        dec.draft_cache.forget()  # no rows to adopt
        drafter = ModelDrafter(dec.draft_cache, dec.manifest.target.dims.vocab, P)
        tokens = np.arange(3, 3 + n + 1, dtype=np.int64)
        planned = drafter.catchup_plan(n + 1, tokens)  # behind by n committed tokens; priced by the draft's clock
        ran.clear()
        drafter.propose(tokens, 3, SamplingParams(), None)
        assert [t for t, _ in ran] == planned + [1, 1] and sum(planned) == n + 1  # then the 2nd and 3rd draws
        assert drafter.catchup_plan(1) == []
    finally:
        runner.step = step


def test_the_draft_catches_up_in_its_cheapest_steps_by_their_measured_times():
    """The draft's catch-up picks its steps by what they cost (its runner's measured step times; a width not yet
    run is priced from a single step): 31 tokens behind with widths 1 and 64, one padded 64-wide step (~100 ms on
    2 cores) instead of 30 single steps (~12 ms each, 378 ms measured on the Qwen 0.5B draft). The target's own
    plan never follows timings (its chunking must not depend on the machine's mood), and the draft's output is
    only proposals."""
    from types import SimpleNamespace

    from specedge.runtime.drafters import StepClock, feed_plan

    runner = SimpleNamespace(entry=SimpleNamespace(widths=[SimpleNamespace(T=1, L=1), SimpleNamespace(T=64, L=1)]),
                             min_width=1, max_context=2048, pads_into_cache=False)
    clock = StepClock()
    assert feed_plan(runner, 31, 24, 64, cost=clock.cost) == feed_plan(runner, 31, 24, 64)  # nothing measured yet
    assert feed_plan(runner, 31, 24, 64) == [(1, False)] * 30 + [(1, True)]  # the width-agnostic rule
    clock.record(1, 0.012)
    assert feed_plan(runner, 31, 24, 64, cost=clock.cost) == [(30, False), (1, True)]  # 64 priced ~8.9 steps
    assert feed_plan(runner, 5, 24, 64, cost=clock.cost) == [(1, False)] * 4 + [(1, True)]
    clock.record(64, 0.030)  # measured: cheaper than priced
    assert feed_plan(runner, 5, 24, 64, cost=clock.cost) == [(4, False), (1, True)]
    plan = feed_plan(runner, 157, 24, 64, cost=clock.cost)
    assert plan == [(64, False), (64, False), (28, False), (1, True)] and sum(t for t, _ in plan) == 157
    clock.record(64, 10.0)  # a (very) slow wide step: single steps again
    assert feed_plan(runner, 5, 24, 64, cost=clock.cost) == [(1, False)] * 4 + [(1, True)]


def test_the_drafts_catch_up_counts_the_rows_it_will_adopt(decoders):
    """A new request's drafter prices its catch-up from the rows another request left in the draft cache that agree
    with its tokens (what ``propose`` adopts), not from an empty cache: a repeated prompt's catch-up is its new
    tokens only (priced from zero, auto's horizon turned a repeated JSON prompt's draft rounds into plain ones)."""
    from specedge.runtime.drafters import ModelDrafter

    dec = decoders["model"]
    P, V = dec.manifest.prefill_chunk, dec.manifest.target.dims.vocab
    params = SamplingParams(max_new_tokens=8)
    first = ModelDrafter(dec.draft_cache, V, P)
    tokens = np.arange(3, 40, dtype=np.int64)
    first.propose(tokens, 2, params, None)  # the cache now holds rows for tokens[:-1] (and a draft row)
    second = ModelDrafter(dec.draft_cache, V, P)
    longer = np.concatenate([tokens, np.arange(50, 55, dtype=np.int64)])
    # the plans carry the first draw's token (longer[-1]) too
    assert sum(second.catchup_plan(len(longer), longer)) == 6  # tokens[-1] and four new ones; the rest adopted
    assert sum(second.catchup_plan(len(longer))) == len(longer)  # without the tokens: its own rows (none)
    other = np.concatenate([tokens[:10], np.arange(60, 80, dtype=np.int64)])
    assert sum(second.catchup_plan(len(other), other)) == len(other) - 10  # agrees for 10 rows only
    second.propose(longer, 2, params, None)
    assert second.rows >= len(longer) - 1


def test_the_draft_reports_the_draw_its_gate_dropped(decoders):
    """keep(conf) is asked after every draw, the first included (whose answer is ignored); the draw that stops a
    round is not proposed, but named in ``dropped`` with its confidence, so auto can check it against the target's
    next token. The kept drafts are the ungated ones' prefix."""
    from specedge.runtime.drafters import ModelDrafter

    dec = decoders["model"]
    tokens = np.arange(3, 20, dtype=np.int64)
    params = SamplingParams(max_new_tokens=8)

    def fresh():
        return ModelDrafter(dec.draft_cache, dec.manifest.target.dims.vocab, dec.manifest.prefill_chunk)

    full = fresh().propose(tokens, 4, params, None)
    asked: list[float] = []
    gated = fresh()
    prop = gated.propose(tokens, 4, params, None, keep=lambda c: asked.append(c) or len(asked) < 3)
    assert prop.tokens.tolist() == full.tokens[:2].tolist()
    assert len(asked) == 3 and all(0.0 < c <= 1.0 for c in asked)
    assert gated.dropped == (int(full.tokens[2]), asked[2]) and gated.confidences == asked[:2]
    never = fresh()
    assert len(never.propose(tokens, 4, params, None, keep=lambda c: False).tokens) == 1 and never.dropped[0] == \
        int(full.tokens[1])
    assert fresh().propose(tokens, 4, params, None, keep=lambda c: True).tokens.tolist() == full.tokens.tolist()
    # keep_last: the draw that stopped the round is proposed all the same (its draft step is paid), as the last
    last = fresh()
    asked_last: list[tuple[float, int]] = []
    prop = last.propose(tokens, 4, params, None, keep=lambda c: c != asked[2],
                        keep_last=lambda c, n: asked_last.append((c, n)) or True)
    assert prop.tokens.tolist() == full.tokens[:3].tolist() and asked_last == [(asked[2], 3)]
    assert last.dropped is None and last.confidences == asked[:3] and last.rows == len(tokens) - 1 + 3
    declined = fresh()
    assert declined.propose(tokens, 4, params, None, keep=lambda c: c != asked[2],
                            keep_last=lambda c, n: False).tokens.tolist() == full.tokens[:2].tolist()
    assert declined.dropped == (int(full.tokens[2]), asked[2])


def test_the_draw_that_rides_with_the_catch_up_is_the_one_a_single_step_gives(decoders):
    """ModelDrafter.propose feeds the tokens its draft has not seen and the last committed token in one step, and
    takes the first draw from that step's last row. The draft then proposes what it proposed with the catch-up
    and the first draw as steps of their own (greedy; the draft's logits are only proposals, but a draw computed
    from another row would cost acceptance)."""
    from specedge.runtime.drafters import ModelDrafter

    dec = decoders["model"]
    P, V = dec.manifest.prefill_chunk, dec.manifest.target.dims.vocab
    params = SamplingParams(max_new_tokens=8)
    rng = np.random.default_rng(5)
    for n in (2, 3, 6, 13, 30):
        tokens = rng.integers(3, V, n).astype(np.int64)
        dec.draft_cache.forget()
        fused = ModelDrafter(dec.draft_cache, V, P)
        got = fused.propose(tokens, 4, params, None).tokens.tolist()
        dec.draft_cache.forget()
        apart = ModelDrafter(dec.draft_cache, V, P)
        apart.propose(tokens, 0, params, None)  # k = 0: catches up on tokens[:-1] only
        assert apart.rows == n - 1
        assert apart.propose(tokens, 4, params, None).tokens.tolist() == got, n


def test_step_costs_are_kept_between_processes(bundles, tmp_path, monkeypatch):
    """auto's step costs are timed once and kept for the next process (a command-line run paid ~1.5 s for them on
    each call): a second decoder of the same bundle reads them instead of timing; a corrupt, stale or foreign entry,
    or one timed the older way, is timed again."""
    import json as _json
    import time as _time

    from specedge.runtime import step_costs as D

    monkeypatch.setenv("SPECEDGE_COST_CACHE", str(tmp_path / "costs"))
    first = SpecDecoder.load(bundles["model"])
    said = []
    costs = first.cost_model(say=said.append)
    path = first.cost_cache_file()
    assert said and path is not None and path.is_file()
    second = SpecDecoder.load(bundles["model"])
    assert second.cost_cache_file() == path
    monkeypatch.setattr(SpecDecoder, "time_steps", lambda *a, **kw: pytest.fail("timed again"))
    again = second.cost_model(say=said.append)
    assert len(said) == 1 and again.target == costs.target and again.draft_widths == costs.draft_widths
    assert SpecDecoder.load(bundles["model"], threads=1).cost_cache_file() != path  # other threads: another key
    monkeypatch.undo()
    monkeypatch.setenv("SPECEDGE_COST_CACHE", str(tmp_path / "costs"))
    fresh = {"timing": D.STEP_TIMING, "measured_at": _time.time(), "steps": {"target": {"2": 0.01}}}
    assert D.read_step_costs(path) is not None
    for bad in ("{not json", _json.dumps({**fresh, "measured_at": _time.time() - 2 * D.COST_CACHE_MAX_AGE_S}),
                _json.dumps({**fresh, "steps": {"target": {"2": -1}}}),
                _json.dumps({**fresh, "timing": D.STEP_TIMING - 1}),  # timed the older way: its shape is suspect
                _json.dumps({k: v for k, v in fresh.items() if k != "timing"})):
        path.write_text(bad)
        assert D.read_step_costs(path) is None
        third = SpecDecoder.load(bundles["model"])
        assert third.cost_model().target and D.read_step_costs(path) is not None  # timed and kept again
    monkeypatch.setenv("SPECEDGE_COST_CACHE", "off")
    assert SpecDecoder.load(bundles["model"]).cost_cache_file() is None


def test_step_timing_takes_the_widths_in_turn_so_a_phase_moves_them_alike(decoders, monkeypatch):
    """``time_steps`` feeds auto's cost model its shape (one width against another). A shared machine that slows
    down halfway through the timing must not make the widths timed late look dearer: each pass takes every width,
    and each width's fastest is kept. (Timed one width after another, the later widths' times were all slow-phase.)"""
    from specedge.runtime import step_costs as D

    dec = decoders["model"]
    base = {T: 0.001 * T for T in (w.T for w in dec.target.entry.widths)}
    clock, calls = [0.0], [0]

    def step(ids, pos, all_logits=False, **kw):  # noqa: ANN001
        calls[0] += 1
        clock[0] += base[len(ids)] * (1.0 if calls[0] <= 2 * len(base) else 3.0)  # the machine slows down
        return None

    monkeypatch.setattr(dec.target, "step", step)
    monkeypatch.setattr(D.time, "perf_counter", lambda: clock[0])
    timed = dec.time_steps(repeats=4, roles=("target",))["target"]
    assert timed == pytest.approx(base)
    calls[0] = 0  # the median instead: the warm-up and one pass fast, three slow
    assert dec.time_steps(repeats=4, roles=("target",), stat="median")["target"] == pytest.approx(
        {T: 3.0 * t for T, t in base.items()})
    with pytest.raises(OptionError, match="median"):
        dec.time_steps(stat="mean")


def test_auto_is_given_the_targets_confidence_in_the_rows_a_requests_first_rounds_commit(decoders, monkeypatch):
    """auto's prior for a request is what its target's confidence predicts the draft passes (TargetSplit): the
    decoder passes the top-1 probability of each row a round commits, for the request's first CONF_WINDOW
    tokens only (a softmax over the vocabulary per row)."""
    from specedge.runtime.adaptive import AutoDrafter

    from ..tools_loader import load_tool

    seen: list[float] = []
    observe = AutoDrafter.observe_confidence
    monkeypatch.setattr(AutoDrafter, "observe_confidence", lambda self, c: (seen.extend(c), observe(self, c)))
    dec = decoders["model"]
    r = dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=100, ignore_eos=True), drafter="auto")
    assert AutoDrafter.CONF_WINDOW <= len(seen) <= AutoDrafter.CONF_WINDOW + dec.manifest.k
    ids = dec.encode_prompt(PROMPTS[0])
    # teacher-forced: the same rows, one per committed token after the prefill's
    forced = load_tool("lookup_replay").target_confidences(dec, ids + r.token_ids, len(ids))[1:]
    np.testing.assert_allclose(seen, forced[: len(seen)], rtol=1e-4)
    seen.clear()
    dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=20, ignore_eos=True), drafter="prompt-lookup")
    assert not seen  # other drafters: no softmax


@pytest.mark.parametrize("bundle, drafter", [("self", "model"), ("lookup", "prompt-lookup"), ("model", "auto")])
def test_the_text_is_the_same_whatever_the_rounds_where_a_character_is_cut(decoders, bundle, drafter):
    """A generation cut by max_new_tokens (or an eos) inside a multi-byte character: the detokenizer's held-back
    tail is the text's end, so speculative text equals plain text equals decode(ids) (the same ids; rounds group
    them differently). Found by review: the held tail was dropped, a whole round's characters with it."""
    dec = decoders[bundle]
    cut = 0
    for prompt in ("héllo wörld — ünïcödé ✓ 数据", "数据 データ"):
        for temperature, seed in ((0.0, None), (1.0, 1)):
            for n in range(1, 25):
                p = SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=temperature, seed=seed)
                plain = dec.generate(prompt, p, drafter="none")
                spec = dec.generate(prompt, p, drafter=drafter, k=8)
                assert spec.token_ids == plain.token_ids
                full = dec.codec.decode(plain.token_ids)
                assert spec.text == plain.text == full, (prompt, temperature, n)
                cut += full.endswith("\ufffd")
    assert cut  # precondition: some of these generations did end inside a character


def test_a_stop_string_completed_beside_half_a_character_ends_the_request_at_that_token(decoders):
    """A token that completes a stop string and also starts a multi-byte character (' \\xe6'): its text is held
    back until the character completes, but the stop string is already there, so the request ends at it."""
    from specedge.runtime.request import Request, commit
    from specedge.runtime.stats import Stats
    from specedge.runtime.text import IncrementalDetokenizer

    dec = decoders["lookup"]
    tok = dec.codec.tok
    held = next(t for t in range(tok.get_vocab_size()) if (s := tok.decode([t])).endswith("\ufffd") and len(s) > 1
                and s[0] != "\ufffd")
    ab = tok.encode("ab", add_special_tokens=False).ids
    stop = "b" + tok.decode([held])[:-1]
    seq = ab + [held] + ab
    for rounds in ([[t] for t in seq], [seq]):  # plain: a token a round; speculative: one round
        req = Request(np.zeros(64, dtype=np.int64), 1, 1, SamplingParams(max_new_tokens=20, stop=(stop,)),
                       np.random.default_rng(0), Stats(), IncrementalDetokenizer(dec.codec), stop_hold=len(stop) - 1)
        text = ""
        for r in rounds:
            text += commit(req, dec.manifest.tokenizer.eos_ids, r).text
            if req.finish:
                break
        assert req.finish == "stop" and req.tokens[1:req.n].tolist() == ab + [held] and text == "a", rounds


def test_accepted_counts_only_the_drafted_tokens_a_request_kept(decoders):
    """A round cut by an eos or a stop string: `accepted` and its histogram count the draft tokens committed, so
    accepted + rounds (each round's own token) + the first token is the request's new tokens."""
    dec = decoders["self"]  # draft == target: every draft accepted
    prompt = "def fib(n):"
    plain = dec.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True), drafter="none")
    manifest = dec.manifest
    try:
        tok = dataclasses.replace(manifest.tokenizer, eos_ids=(plain.token_ids[3],))
        dec.manifest = dataclasses.replace(manifest, tokenizer=tok)
        eos = dec.generate(prompt, SamplingParams(max_new_tokens=24), drafter="model", k=8)
    finally:
        dec.manifest = manifest
    stop = dec.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True,
                                               stop=(dec.codec.decode(plain.token_ids[:4])[-2:],)),
                        drafter="model", k=8)
    for res in (eos, stop):
        s = res.stats
        assert s.rounds == 1 and s.drafted == 8  # precondition: the first round's draft was cut (no own token)
        assert s.accepted == sum(i * c for i, c in enumerate(s.accept_hist)) == len(res.token_ids) - 1, s


def test_a_target_that_computes_a_lone_logits_row_exactly_feeds_a_prompt_s_rest_in_one_step():
    """``lone_last``: the rest after the full chunks goes in the steps its fixed prices make cheapest, the last one
    asking for its row's logits alone (the runner computes that row by itself); without it the rest goes in an
    all-logits width, or the last token waits for one."""
    from types import SimpleNamespace

    from specedge.runtime.drafters import feed_plan

    widths = [SimpleNamespace(T=t, L=t) for t in (1, 2, 3, 5, 9, 16, 48)] + [SimpleNamespace(T=64, L=1)]
    runner = SimpleNamespace(entry=SimpleNamespace(widths=widths), min_width=1, max_context=2048,
                             pads_into_cache=False)
    assert feed_plan(runner, 40, 0, 64) == [(40, True)]
    assert feed_plan(runner, 60, 0, 64) == [(59, False), (1, True)]
    assert feed_plan(runner, 100, 0, 64) == [(64, False), (36, True)]
    for n in (2, 9, 40, 49, 51, 60, 64, 100, 300):
        plan = feed_plan(runner, n, 0, 64, lone_last=True)
        assert sum(t for t, _ in plan) == n and not any(every for _, every in plan), (n, plan)
    # the cheapest by its fixed prices: 51 rows as 48 + 3, not in the 64-row width; 40 in one step of 48
    assert sorted(feed_plan(runner, 51, 0, 64, lone_last=True)) == [(3, False), (48, False)]
    assert feed_plan(runner, 40, 0, 64, lone_last=True) == [(40, False)]
    assert feed_plan(runner, 300, 0, 64, lone_last=True)[:4] == [(64, False)] * 4


def test_step_costs_are_timed_at_a_short_context_with_each_widths_cost_per_position(monkeypatch, tmp_path):
    """auto's step costs come from a short context (a chat or code prompt's), not from a quarter of S_max, which puts
    a 32k bundle's every step at 8,192 positions; a few widths are timed again deep in the cache, in turn with the
    short ones, and their difference per position is what the cost model adds for a request's own context. Kept
    with the costs, and read back whole."""
    import json as _json
    from types import SimpleNamespace

    from specedge.runtime import step_costs as D

    clock, seen = [0.0], []

    def step(ids, pos, all_logits=False, **kw):  # noqa: ANN001
        seen.append(pos)
        clock[0] += 0.010 + 0.002 * len(ids) + 1e-6 * len(ids) * pos  # attention: rows x positions
        return None

    widths = [SimpleNamespace(T=t, L=t) for t in (1, 2, 5)] + [SimpleNamespace(T=64, L=1)]
    runner = SimpleNamespace(entry=SimpleNamespace(widths=widths), step=step)
    monkeypatch.setattr(D.time, "perf_counter", lambda: clock[0])
    assert D.cost_depth(32768) == D.COST_DEPTH == 128 and D.cost_depth(256) == 64
    timed = D.time_runner(runner, 32768, 2, None, True, min)
    assert set(timed) == {1, 2, 5} and set(seen) == {128}
    assert timed[5] == pytest.approx(0.010 + 0.010 + 5 * 128e-6)
    slopes = D.time_slopes(runner, 32768, [1, 5, 64], 2, min)  # 64: a prefill width, not timed
    assert slopes == pytest.approx({1: 1e-6, 5: 5e-6}) and set(seen) == {128, D.DEEP_DEPTH}
    assert D.time_slopes(runner, 2048, [1, 5], 2, min) == pytest.approx({1: 1e-6, 5: 5e-6})  # 128 and 1,024
    assert D.time_slopes(runner, 512, [1, 5], 2, min) == {}  # 128 and 256: too close to tell apart
    path = tmp_path / "costs.json"
    kept = D.StepCosts({"target": timed, "draft": {1: 0.004}}, 128, {"target": slopes})
    D.write_step_costs(path, kept)
    assert D.read_step_costs(path) == kept
    raw = _json.loads(path.read_text())
    path.write_text(_json.dumps({**raw, "slopes": {"target": {"1": -1.0}}}))
    assert D.read_step_costs(path) is None  # a negative cost per position: timed again


def test_auto_prices_each_round_at_the_requests_own_context(decoders, monkeypatch):
    """The decoder tells the cost model the context each round's steps attend over (the request's tokens so far)
    before its drafter chooses, so auto weighs a long prompt's rounds at their depth."""
    from specedge.runtime.adaptive import AutoDrafter

    dec = decoders["model"]
    costs = dec.cost_model()
    depths: list[int] = []
    propose = AutoDrafter.propose
    monkeypatch.setattr(AutoDrafter, "propose", lambda self, tokens, *a, **kw: (
        depths.append((costs.depth, len(tokens))), propose(self, tokens, *a, **kw))[1])
    dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=24, ignore_eos=True), drafter="auto")
    n = len(dec.encode_prompt(PROMPTS[0]))
    assert depths and all(d == t for d, t in depths) and depths[0][0] == n + 1 and depths[-1][0] > n + 1

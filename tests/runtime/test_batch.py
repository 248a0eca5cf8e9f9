"""Requests decoded together (max_batch > 1): every request's tokens are bitwise those it gets decoded alone, with
every drafter, greedy and keyed, whatever rounds it joins and leaves at."""

from __future__ import annotations

import dataclasses
import json
import random
import socket
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from specedge.export.bundle import ExportOptions, export_bundle
from specedge.export.quant import WeightFormat
from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.batch import plan_rows
from specedge.runtime.errors import BackendUnavailableError, OptionError
from specedge.runtime.manifest import ROWS_KV_MODE, read_manifest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the kernels are built with a POSIX C compiler")

PROMPTS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\ndef fib(n):",
    "the cat sat on the mat. the cat sat on the",
    "hello world, hello",
    "a b c d e f g a b c d",
    "import numpy as np\nimport numpy as",
    "x = 1\ny = 2\nz = x + y\nx = 1\ny =",
]


@pytest.fixture(scope="module")
def rows_bundles(tmp_path_factory, tiny_llama, tiny_draft):
    root = tmp_path_factory.mktemp("rows-bundles")
    opts = ExportOptions(k=4, max_context=160, prefill_chunk=16, kv_mode=ROWS_KV_MODE, kv_dtype="float16",
                         weights=WeightFormat("int4", form="specedge"))  # the CPU profile's form
    return {"model": export_bundle(tiny_llama, tiny_draft, root / "model", opts).out,
            "lookup": export_bundle(tiny_llama, "prompt-lookup", root / "lookup", opts).out}


@pytest.fixture(scope="module")
def solo(rows_bundles):
    return SpecDecoder.load(rows_bundles["model"])


def alone(dec, prompt, params, drafter):
    return dec.generate(prompt, params, drafter=drafter).token_ids


def drain(streams, rng=None):
    """Read every stream to its end, an event at a time: round-robin, or in ``rng``'s random order. Each stream's
    tokens and its final event's stats."""
    got, stats = [[] for _ in streams], [None] * len(streams)
    live = list(range(len(streams)))
    while live:
        for i in ([rng.choice(live)] if rng is not None else list(live)):
            try:
                ev = next(streams[i])
            except StopIteration:
                live.remove(i)
                continue
            got[i] += ev.token_ids
            stats[i] = ev.stats or stats[i]
    return got, stats


PARAMS = {"greedy": SamplingParams(max_new_tokens=24, ignore_eos=True),
          "keyed": SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)}


def test_a_rows_bundle_declares_batch_widths_and_decodes_alone_like_an_inplace_one(rows_bundles, tiny_llama,
                                                                                   tmp_path, solo):
    m = read_manifest(rows_bundles["model"])
    assert m.kv_mode == ROWS_KV_MODE
    assert max(w.T for w in m.target.widths if w.L == w.T) == 48
    inplace = SpecDecoder.load(export_bundle(tiny_llama, "prompt-lookup", tmp_path / "inplace", ExportOptions(
        k=4, max_context=160, prefill_chunk=16, kv_mode="ort-inplace", kv_dtype="float16",
        weights=WeightFormat("int4", form="specedge"))).out)
    for p in PROMPTS[:3]:
        assert alone(solo, p, PARAMS["greedy"], "none") == alone(inplace, p, PARAMS["greedy"], "none")


def test_a_prompt_s_last_step_computes_the_one_logits_row_it_needs(rows_bundles):
    """specedge's kernels compute a lone logits row as they compute it inside a wider step, so a prompt's last step
    (and its shorter remainder chunks) runs the lm_head for its last row only, not for every row of its width, and
    the first token is the same bit for bit: alone, in a batch, fed whole or after a cached prefix."""
    dec = SpecDecoder.load(rows_bundles["lookup"], max_batch=2)
    target = dec.target
    assert target.min_width == 1  # (the form whose lone rows are exact)
    picked, pick = [], target._pick

    def recording(n, all_logits, past_len):
        b = pick(n, all_logits, past_len)
        picked.append((n, b.width.T, b.width.L))
        return b

    target._pick = recording
    prompt = PROMPTS[0]
    n = len(dec.encode_prompt(prompt))
    assert n > 16 and n % 16 not in (0, 1)  # a chunk of 16, then a remainder of several rows
    dec.generate(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True), drafter="none")
    target._pick = pick
    fed = picked[: n // 16 + 1]
    assert sum(t for t, _, _ in fed) == n and all(L == 1 for _, _, L in fed), picked
    ids = np.arange(5, 5 + 27, dtype=np.int64)
    for n in (2, 5, 11, 16, 27):
        last = target.step(ids[:n], 0, all_logits=False)[0].copy()
        every = target.step(ids[:n], 0, all_logits=True)[n - 1]
        assert np.array_equal(last, every), n
    # what validation records as a step's inputs stays a declared width's (an engine is built for those)
    recorded = target.feed(ids[:5], 0, all_logits=False)
    assert recorded["logits_at"].shape == (1, 5) and recorded["input_ids"].shape == (1, 5)


def test_a_row_addressed_step_computes_the_logits_of_the_rows_asked_for(rows_bundles):
    """``step_rows(logits_rows=)``: a prompt's rows and other requests' decoding rows in one step, the logits of the
    rows asked for only, each bitwise what the step computes for it with every row's logits."""
    dec = SpecDecoder.load(rows_bundles["lookup"], max_batch=3)
    target = dec.target
    ids = np.arange(7, 7 + 20, dtype=np.int64)
    for slot in (0, 1):
        target.step(ids, 0, all_logits=False, slot=slot)
    tokens = [*ids[:2], *ids[5:15]]  # two decoding rows, then ten rows of a prompt in slot 2
    slots, positions = [0, 1] + [2] * 10, [20, 20, *range(10)]
    every = target.step_rows(tokens, slots, positions).copy()
    for s in (0, 1):  # the decoding rows' K/V were written again: the same bits, so the same cache
        target.step(ids, 0, all_logits=False, slot=s)
    some = target.step_rows(tokens, slots, positions, logits_rows=[0, 1, 11])
    assert some.shape == (3, every.shape[1])
    assert np.array_equal(some, every[[0, 1, 11]])
    with pytest.raises(ValueError, match="logits_rows"):
        target.step_rows(tokens, slots, positions, logits_rows=[0, 12])


@pytest.mark.parametrize("mode", ["greedy", "keyed"])
def test_a_prompt_rides_in_the_steps_of_the_requests_decoding(rows_bundles, solo, mode):
    """A request that joins while others decode feeds its prompt in their rounds' steps, as many rows a round as the
    prefill chunk leaves, with no step of its own; every request's tokens are still its tokens alone."""
    params = PARAMS[mode]
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    want = [alone(solo, p, params, "none") for p in prompts]
    dec = SpecDecoder.load(rows_bundles["lookup"], max_batch=3)
    streams = [dec.stream(p, params, drafter="none") for p in prompts[:2]]
    got = [next(s).token_ids for s in streams] + [[]]
    got[0] += next(streams[0]).token_ids  # both decoding now
    own_steps, step = [], dec.target.step

    def recording(tokens, past_len, all_logits, ids_only=False, slot=0):
        own_steps.append((slot, past_len, len(tokens)))
        return step(tokens, past_len, all_logits, ids_only, slot)

    dec.target.step = recording
    streams.append(dec.stream(prompts[2], params, drafter="none"))
    n = len(dec.encode_prompt(prompts[2]))
    assert n > 2 * dec.manifest.prefill_chunk - 4  # several rounds' worth of rows
    live = [0, 1, 2]
    while live:
        for i in list(live):
            try:
                got[i] += next(streams[i]).token_ids
            except StopIteration:
                live.remove(i)
    assert got == want
    assert dec.batch.shared_prefill >= 3, dec.batch.shared_prefill
    # the third prompt's rows took no step of their own (its steps past the prompt: decoding alone at the end)
    assert not [s for s in own_steps if s[0] == 2 and s[1] < n - 1], own_steps


@pytest.mark.parametrize("mode", ["greedy", "keyed"])
def test_the_draft_model_drafts_for_requests_together_in_shared_steps(rows_bundles, solo, mode, monkeypatch):
    """Requests decoded together whose drafter is the draft model draft in shared draft steps, each in a draft slot
    of its own; each one's tokens are still its tokens alone. (Drafting, the draft's catch-ups and verify rows are
    priced free here, so that every round drafts as far as it may whatever the machine's timings: the output must
    not depend on it.)"""
    params = PARAMS[mode]
    prompts, drafters = PROMPTS[:4], ["model", "auto", "model", "hybrid"]
    want = [alone(solo, p, params, d) for p, d in zip(prompts, drafters)]
    dec = SpecDecoder.load(rows_bundles["model"], max_batch=3)
    assert dec.draft_runner.slots == 3 and len(dec.draft_caches) == 3
    costs = dec.cost_model()
    costs.draft_widths = {t: 1e-9 for t in costs.draft_widths}
    monkeypatch.setattr(costs, "verify_time", lambda rows, depth=None: 1e-3)
    monkeypatch.setattr(costs, "catchup_time", lambda plan: 1e-9)  # (else a slow machine's catch-up skips the draft)
    got, stats = drain([dec.stream(p, params, drafter=d) for p, d in zip(prompts, drafters)], random.Random(1))
    assert got == want
    assert sum(st.strategies.get("batch-model", 0) for st in stats) >= 4, [st.strategies for st in stats]
    assert sum(st.accepted for st in stats) > 0  # (some drafts were right: the draft's rows were the right ones)


@pytest.mark.parametrize("mode", ["greedy", "keyed"])
def test_drafts_drawn_together_are_the_drafts_drawn_alone(rows_bundles, solo, mode):
    """The shared draft steps draw for each request what its draft model alone would propose from its committed
    tokens (the draft's kernels compute each row the same in any step): the right slot, rows and positions."""
    params = PARAMS[mode]
    dec = SpecDecoder.load(rows_bundles["model"], max_batch=2)
    streams = [dec.stream(p, params, drafter="model") for p in PROMPTS[:2]]
    for s in streams:
        next(s)  # prompts fed, first tokens committed
    next(streams[0])  # and one round each: the draft caches hold rows, a token or more behind
    members = list(dec.batch.members)
    with dec._lock:
        together = dec.batch._draft_together([(m, 3) for m in members])
    for m, drafts in zip(members, together):
        solo.draft_cache.forget()
        alone_drafter = solo.make_drafter("model")
        prop = alone_drafter.propose(m.req.tokens[: m.req.n].copy(), 3, params, None)
        assert drafts.tolist() == prop.tokens.tolist()
    for s in streams:
        s.close()


def _interleaved_as_alone(bundle, solo, params) -> None:
    drafters = ["none", "prompt-lookup", "auto", "model", "hybrid", "auto"]
    want = [alone(solo, p, params, d) for p, d in zip(PROMPTS, drafters)]
    dec = SpecDecoder.load(bundle, max_batch=4)
    streams = [dec.stream(p, params, drafter=d) for p, d in zip(PROMPTS, drafters)]
    got = [[] for _ in streams]
    live = list(range(len(streams)))
    rng = random.Random(0)
    while live:
        i = rng.choice(live)
        try:
            got[i] += next(streams[i]).token_ids
        except StopIteration:
            live.remove(i)
    assert got == want
    assert any(n >= 2 for n in dec.batch.sizes), dec.batch.sizes  # rounds really were shared
    assert not dec.batch.members and not dec.batch.waiting


@pytest.mark.parametrize("mode", ["greedy", "keyed"])
def test_interleaved_streams_decode_together_bitwise_as_alone(rows_bundles, solo, mode):
    """Streams interleaved in one thread join one batch; each one's tokens are its tokens alone, every drafter."""
    _interleaved_as_alone(rows_bundles["model"], solo, PARAMS[mode])


@pytest.mark.parametrize("mode", ["greedy", "keyed"])
def test_an_int8_cache_decodes_each_request_of_a_batch_as_alone(tmp_path_factory, tiny_llama, tiny_draft, mode):
    """The same with int8 KV caches (target and draft model): each request bitwise its tokens alone, and alone every
    drafter's text is plain decoding's."""
    opts = ExportOptions(k=4, max_context=160, prefill_chunk=16, kv_mode=ROWS_KV_MODE, kv_dtype="int8",
                         weights=WeightFormat("int4", form="specedge"))
    bundle = export_bundle(tiny_llama, tiny_draft, tmp_path_factory.mktemp("int8-rows"), opts).out
    solo = SpecDecoder.load(bundle)
    assert solo.target.kv.dtype == np.int8 and solo.draft_runner.kv.dtype == np.int8
    for p in PROMPTS[:3]:
        plain = alone(solo, p, PARAMS[mode], "none")
        assert all(alone(solo, p, PARAMS[mode], d) == plain for d in ("prompt-lookup", "model", "auto")), p
    _interleaved_as_alone(bundle, solo, PARAMS[mode])


class Oracle:
    """Proposes what a request will commit (its text alone), each token wrong with probability ``wrong``: drafts
    that are accepted, rejected at a known rate, or cut short."""

    name = "prompt-lookup"

    def __init__(self, futures: list[np.ndarray], wrong: float, seed: int):
        self.futures, self.wrong, self.rng = futures, wrong, random.Random(seed)

    def propose(self, tokens, k, params, rng):  # noqa: ANN001
        from specedge.runtime.drafters import Proposal

        n = len(tokens)
        full = next(f for f in self.futures if len(f) > n and np.array_equal(f[:n], tokens))
        out = [int(t) if self.rng.random() > self.wrong else int(t) ^ 1 for t in full[n: n + k]]
        return Proposal(np.asarray(out[: self.rng.randint(0, k)], dtype=np.int64), None)


@pytest.mark.parametrize("mode", ["greedy", "keyed"])
def test_batched_drafts_accepted_and_rejected_commit_exactly(rows_bundles, solo, monkeypatch, mode):
    """Every drafted token verified (the planner told to take all) from drafts that are often right: batched rounds
    accept drafts, reject them and commit each request's tokens as alone."""
    import specedge.runtime.batch as batch

    params = dataclasses.replace(PARAMS[mode], max_new_tokens=40)
    want = [alone(solo, p, params, "none") for p in PROMPTS[:4]]
    futures = [np.asarray(solo.encode_prompt(p) + w) for p, w in zip(PROMPTS, want)]
    monkeypatch.setattr(batch, "plan_rows", lambda alphas, drafted, step_time, budget: list(drafted))
    monkeypatch.setattr(batch.Member, "lookup", property(lambda m: Oracle(futures, 0.25, m.req.n)))
    dec = SpecDecoder.load(rows_bundles["lookup"], max_batch=4)
    got, stats = drain([dec.stream(p, params, drafter="prompt-lookup") for p in PROMPTS[:4]])
    assert got == want
    assert sum(s.accepted for s in stats) > 20 and sum(s.drafted - s.accepted for s in stats) > 5
    assert all(s.strategies.get("batch-prompt-lookup") for s in stats)


def test_requests_from_threads_arriving_and_leaving_at_random_rounds_are_exact(rows_bundles, solo):
    rng = random.Random(1)
    jobs = []
    for j in range(12):
        p = PROMPTS[j % len(PROMPTS)] + " " * (j // len(PROMPTS))
        params = SamplingParams(max_new_tokens=rng.randint(1, 30), ignore_eos=True, temperature=rng.choice([0, 0.8]),
                                seed=j)
        jobs.append((p, params, rng.choice(["none", "prompt-lookup", "auto", "model"])))
    want = [alone(solo, *job) for job in jobs]
    dec = SpecDecoder.load(rows_bundles["model"], max_batch=3)
    got: list = [None] * len(jobs)

    def run(i):
        threading.Event().wait(rng.random() * 0.05)
        got[i] = alone(dec, *jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want


def test_a_closed_stream_leaves_the_batch_and_frees_its_slot(rows_bundles, solo):
    params = PARAMS["greedy"]
    dec = SpecDecoder.load(rows_bundles["lookup"], max_batch=2)
    a, b = dec.stream(PROMPTS[0], params), dec.stream(PROMPTS[1], params)
    next(a), next(b), next(a)
    a.close()
    assert len(dec.batch.members) == 1
    rest = dec.generate(PROMPTS[2], params).token_ids  # takes a's slot while b is still open
    assert rest == alone(SpecDecoder.load(rows_bundles["lookup"]), PROMPTS[2], params, "auto")
    b.close()
    assert not dec.batch.members


def test_a_request_joins_the_batch_while_a_round_holds_the_lock(rows_bundles, solo):
    """A new request joins the waiting line at once, not when the streams running rounds let go of the round lock
    (they take it again round after round: a join behind them waited for seconds, uncounted in its time to first
    token); its first round then admits it."""
    params = PARAMS["greedy"]
    dec = SpecDecoder.load(rows_bundles["lookup"], max_batch=2)
    stream, got = dec.stream(PROMPTS[1], params, drafter="none"), []
    with dec._lock:  # a round in progress
        reader = threading.Thread(target=lambda: got.append(next(stream)))
        reader.start()
        for _ in range(500):
            if dec.batch.waiting:
                break
            threading.Event().wait(0.01)
        assert [m.req for m in dec.batch.waiting] and not got
    reader.join(timeout=60)
    assert got and got[0].token_ids
    rest, _ = drain([stream])
    assert got[0].token_ids + rest[0] == alone(solo, PROMPTS[1], params, "none")


def test_a_stream_closed_while_a_round_holds_the_lock_leaves_at_the_next_round(rows_bundles, solo):
    """(The garbage collector can finalize a stream inside a round, on the thread that holds the lock.)"""
    params = PARAMS["greedy"]
    dec = SpecDecoder.load(rows_bundles["lookup"], max_batch=2)
    a, b = dec.stream(PROMPTS[0], params), dec.stream(PROMPTS[1], params)
    got = next(b).token_ids
    next(a)
    with dec._lock:
        a.close()  # cannot take the lock: deferred, no deadlock
    assert len(dec.batch.members) == 2
    got += [t for ev in b for t in ev.token_ids]
    assert not dec.batch.members and got == alone(solo, PROMPTS[1], params, "auto")


def test_prefix_reuse_finds_the_slot_that_holds_the_previous_turn(rows_bundles):
    dec = SpecDecoder.load(rows_bundles["lookup"], max_batch=2)
    params = PARAMS["greedy"]
    first = dec.generate(PROMPTS[0], params)
    dec.generate(PROMPTS[1], params)  # another request, in the other slot
    follow = dec.generate(PROMPTS[0] + first.text + "\nagain", params)
    assert follow.stats.reused_tokens >= first.stats.prompt_tokens


def recorded_rows(runner):
    """Record the (slot, position) of every row ``runner``'s steps compute, single-sequence steps and
    row-addressed ones alike."""
    rows, step, step_rows = [], runner.step, runner.step_rows

    def one(tokens, past_len, all_logits, ids_only=False, slot=0):
        rows.extend((slot, past_len + i) for i in range(len(tokens)))
        return step(tokens, past_len, all_logits, ids_only, slot)

    def many(tokens, slots, positions, *args, **kwargs):
        rows.extend(zip(slots, positions))
        return step_rows(tokens, slots, positions, *args, **kwargs)

    runner.step, runner.step_rows = one, many
    return rows


SHARED = "You are a careful assistant: answer in one short line, exactly. " * 2


@pytest.mark.parametrize("mode", ["greedy", "keyed"])
def test_a_prompt_prefix_another_slot_holds_is_copied_not_computed(rows_bundles, solo, mode):
    """A request whose prompt starts as another slot's request did (a shared system prompt) takes those rows from
    that slot, the target's and the draft's, instead of computing them again; its tokens are still its tokens
    alone, and its draft model drafts from the copied rows what it drafts alone."""
    params = PARAMS[mode]
    prompts = [SHARED + "Name a colour.", SHARED + "Name a bird."]
    want = [alone(solo, p, params, "model") for p in prompts]
    dec = SpecDecoder.load(rows_bundles["model"], max_batch=2)
    first = dec.stream(prompts[0], params, drafter="model")
    got = [next(first).token_ids, []]
    got[0] += next(first).token_ids  # a round decoded: its draft cache holds the prompt's rows too
    target_rows, draft_rows = recorded_rows(dec.target), recorded_rows(dec.draft_runner)
    second = dec.stream(prompts[1], params, drafter="model")
    got[1] += next(second).token_ids
    a, b = (np.asarray(dec.encode_prompt(p)) for p in prompts)
    shared = int(np.flatnonzero(a[: len(b)] != b[: len(a)])[0])  # the tokens the two prompts start with
    [mb] = [m for m in dec.batch.members if m.slot.index == 1]
    reused = mb.req.stats.reused_tokens
    assert reused >= shared and dec.batch.borrowed == reused, (reused, shared, dec.batch.borrowed)
    assert not [r for r in target_rows if r[0] == 1 and r[1] < reused], target_rows
    with dec._lock:  # its draft model, drafting alone from the rows copied into its slot
        prop = mb.drafter.propose(mb.req.tokens[: mb.req.n].copy(), 3, params, None)
    solo.draft_cache.forget()
    assert prop.tokens.tolist() == solo.make_drafter("model").propose(mb.req.tokens[: mb.req.n].copy(), 3, params,
                                                                      None).tokens.tolist()
    assert not [r for r in draft_rows if r[0] == 1 and r[1] < reused - 1], draft_rows
    rest, _ = drain([first, second])
    assert [g + r for g, r in zip(got, rest)] == want


def test_rows_written_over_during_a_prefill_start_that_prefill_again(rows_bundles, solo, monkeypatch):
    """The step timings (SpecDecoder.time_steps) write dummy rows in slot 0 between rounds: a request feeding its
    prompt there, one chunk a round beside a decoding one, starts its prefill again."""
    import specedge.runtime.batch as batch

    params = PARAMS["greedy"]
    long = " ".join(PROMPTS[:3])  # several prefill chunks
    want = alone(solo, long, params, "none")
    dec = SpecDecoder.load(rows_bundles["lookup"], max_batch=2)
    assert dec.generate(PROMPTS[2], params).token_ids == alone(solo, PROMPTS[2], params, "auto")  # slot 0, freed
    other = dec.stream(PROMPTS[1], params, drafter="none")
    next(other)  # decoding in slot 1
    real, chunks = batch.Batch._prefill, []

    def prefill(self, m, whole):
        real(self, m, whole)
        chunks.append(m.fed)
        if len(chunks) == 2:  # what time_steps does between two rounds: dummy rows in slot 0, forgotten
            dec.target.step(np.arange(9) + 3, 0, all_logits=True)
            dec.slots[0].rows.forget()

    monkeypatch.setattr(batch.Batch, "_prefill", prefill)
    got = [tok for ev in dec.stream(long, params, drafter="none") for tok in ev.token_ids]
    assert got == want
    assert len(chunks) > 3 and dec.slots[0].rows.of is not None
    other.close()


def test_an_interrupted_batched_round_loses_nothing(rows_bundles, solo, monkeypatch):
    """KeyboardInterrupt before or after shared steps: the stream that ran the round ends with it, the others
    go on exact, and so do later requests."""
    params = PARAMS["greedy"]
    dec = SpecDecoder.load(rows_bundles["lookup"], max_batch=3)
    real, calls = dec.target.step_rows, [0]

    def flaky(*a, **kw):
        calls[0] += 1
        if calls[0] % 5 == 0:
            raise KeyboardInterrupt
        out = real(*a, **kw)
        if calls[0] % 7 == 0:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(dec.target, "step_rows", flaky)
    streams = {i: dec.stream(p, params, drafter="prompt-lookup") for i, p in enumerate(PROMPTS[:3])}
    got = {i: [] for i in streams}
    broken = set()
    while streams:
        for i, st in list(streams.items()):
            try:
                got[i] += next(st).token_ids
            except StopIteration:
                del streams[i]
            except KeyboardInterrupt:
                broken.add(i)
                del streams[i]
    assert broken, "no round was interrupted"
    for i in got:
        if i not in broken:
            assert got[i] == alone(solo, PROMPTS[i], params, "none")
    monkeypatch.setattr(dec.target, "step_rows", real)
    for p in PROMPTS[:3]:
        assert alone(dec, p, params, "prompt-lookup") == alone(solo, p, params, "none")
    assert not dec.batch.members


def test_max_batch_needs_a_row_addressed_bundle(bundles):
    with pytest.raises(BackendUnavailableError, match="kv_mode rows"):
        SpecDecoder.load(bundles["lookup"], max_batch=2)
    for bad in (0, 49, True, 2.0):
        with pytest.raises(OptionError, match="max_batch"):
            SpecDecoder.load(bundles["lookup"], max_batch=bad)


def test_plan_rows_speculates_where_rows_are_cheap_and_drafts_are_good():
    cheap = lambda r: 1.0 + 0.01 * r  # noqa: E731 - rows nearly free
    dear = lambda r: float(r)  # noqa: E731 - every row costs a step
    assert plan_rows([0.9, 0.9], [4, 4], cheap, 48) == [4, 4]
    assert plan_rows([0.9, 0.9], [4, 4], dear, 48) == [0, 0]
    assert plan_rows([0.9, 0.1], [4, 4], cheap, 48)[0] == 4
    assert sum(plan_rows([0.9] * 8, [8] * 8, cheap, 48)) <= 40  # within the row budget
    assert plan_rows([0.5], [0], cheap, 48) == [0]
    widths = [2, 5, 8]
    stepped = lambda r: next((1.0 + 0.1 * t for t in widths if t >= r), float("inf"))  # noqa: E731
    take = plan_rows([0.6, 0.6], [3, 3], stepped, 8)
    assert sum(take) + 2 <= 8 and np.all(np.asarray(take) >= 0)


def test_plan_counts_a_kv_cache_per_request_decoded_together(rows_bundles, bundles):
    from click.testing import CliRunner

    from specedge.export.cli import main

    def target_kv(bundle, n):
        r = CliRunner().invoke(main, ["plan", str(bundle), "--json", "--max-batch", str(n)])
        assert r.exit_code in (0, 1), r.output
        import json

        return next(m["kv"] for m in json.loads(r.output)["models"] if m["role"] == "target")

    assert target_kv(rows_bundles["lookup"], 4) == 4 * target_kv(rows_bundles["lookup"], 1)
    r = CliRunner().invoke(main, ["plan", str(bundles["lookup"]), "--max-batch", "2"])
    assert r.exit_code != 0 and "kv_mode rows" in r.output


def test_a_mixed_storm_of_clients_on_a_batching_server(rows_bundles, solo):
    """16 clients at once on a server decoding 3 together: streaming and not, greedy and keyed, clients that leave
    mid-answer, bad requests and a full queue. Every answer is its text alone, every error typed, nothing hangs."""
    pytest.importorskip("uvicorn")
    from .test_server import Running

    s = Running(rows_bundles["lookup"], max_batch=3, max_queue=8)
    try:
        assert len(s.srv._workers) == 3
        keyed = SamplingParams(max_new_tokens=20, temperature=0.8, seed=5)
        want = {(p, t): s.dec.generate(p, SamplingParams(max_new_tokens=20) if t == 0 else keyed,
                                       chat=False).text for p in PROMPTS for t in (0, 0.8)}

        def client(i):
            p, kind = PROMPTS[i % len(PROMPTS)], i % 4
            temp = 0 if i % 3 else 0.8
            extra = {"seed": 5} if temp else {}
            if kind == 3 and i % 8 == 3:  # a bad request: a typed 400, nothing queued
                return "bad", s.post("/v1/completions", {"prompt": p, "max_tokens": -1})[0]
            if kind == 2:  # a streaming client that leaves after its first event
                body = json.dumps({"prompt": p, "max_tokens": 200, "stream": True, "temperature": 0}).encode()
                conn = socket.create_connection(("127.0.0.1", s.port))
                conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                conn.settimeout(60)
                got = b""
                while b"data:" not in got and b"HTTP/1.1 503" not in got:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    got += chunk
                conn.close()
                return "left", None
            if kind == 1:
                chunks = s.client.completions.create(model="tiny", prompt=p, temperature=temp, max_tokens=20,
                                                     stream=True, extra_body=extra)
                return "ok", (p, temp, "".join(c.choices[0].text for c in chunks if c.choices))
            code, body, _ = s.post("/v1/completions", {"prompt": p, "temperature": temp, "max_tokens": 20, **extra})
            if code == 503:
                return "busy", body["error"]["code"]
            return "ok", (p, temp, body["choices"][0]["text"])

        with ThreadPoolExecutor(16) as ex:
            results = list(ex.map(client, range(16)))
        for kind, r in results:
            if kind == "ok":
                p, temp, text = r
                assert text == want[(p, temp)]
            elif kind == "bad":
                assert r == 400
            elif kind == "busy":
                assert r == "overloaded"
        assert sum(k == "ok" for k, _ in results) >= 6
        r = s.client.completions.create(model="tiny", prompt=PROMPTS[0], temperature=0, max_tokens=20)
        assert r.choices[0].text == want[(PROMPTS[0], 0)]  # still serving, still exact
        metrics = urllib.request.urlopen(s.url + "/metrics", timeout=10).read().decode()
        assert 'specedge_batch_rounds_total{requests="2"}' in metrics or \
            'specedge_batch_rounds_total{requests="3"}' in metrics
    finally:
        s.close()


def test_the_concurrency_benchmark_sends_the_same_requests_at_every_concurrency(rows_bundles, tmp_path):
    """tools/bench_concurrency.py's load against a batching server: every request answered, its text what it is
    alone, and the report says so."""
    pytest.importorskip("uvicorn")
    import argparse

    from ..tools_loader import load_tool
    from .test_server import Running

    tool = load_tool("bench_concurrency")
    s = Running(rows_bundles["lookup"], max_batch=2)
    try:
        runs = []
        for c in (1, 2):
            r = tool.load(s.port, "tiny", PROMPTS[:3], c, 5, 12, {"speculation": {"drafter": "auto"}})
            r["system"] = "specedge"
            runs.append(r)
        salted = [tool.load(s.port, "tiny", PROMPTS[:3], c, 3, 12, {}, salt="x") for c in (1, 3)]
        told = [tool.load(s.port, "tiny", PROMPTS[:3], c, 3, 12, {}, salt="x", system="Answer briefly.")
                for c in (1, 3)]
    finally:
        s.close()
    assert [r["requests"] for r in runs] == [5, 5] and not runs[0]["errors"]
    assert runs[0]["texts"] == runs[1]["texts"] and runs[1]["tokens"] > 5
    assert salted[0]["texts"] == salted[1]["texts"] != {k: runs[0]["texts"][k] for k in salted[0]["texts"]}
    assert told[0]["texts"] == told[1]["texts"] != salted[0]["texts"]  # (the system message reached the model)
    args = argparse.Namespace(bundle="b", requests=5, max_new_tokens=12, threads=2, system=None)
    runs[1]["texts_as_alone"] = "5/5"
    tool.report(runs, {"cpu": "cpu", "cpus": 2, "cpu_flags": "avx2"}, args, tmp_path)
    assert "| specedge | 2 |" in (tmp_path / "report.md").read_text() and "5/5" in (tmp_path / "report.md").read_text()

"""Exceptions anywhere in a request leave the caches' bookkeeping true: an interrupted prefill, resync, draft,
verify or commit never lets a later request reuse rows that were not written for its tokens.

A KeyboardInterrupt (Ctrl-C in a notebook, a timeout) or any exception raised inside a step ends that request; the
decoder then serves the next ones with the text plain decoding gives them."""

from __future__ import annotations

import random
import sys
import threading

import numpy as np
import pytest

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime import decoder as decoder_module

SHARED = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n" * 3
LONG = SHARED + "The quick brown fox jumps over the lazy dog. The capital of France is Paris."
OTHER = SHARED + "import numpy as np\nx = np.arange(10)\nprint(x.sum())\n"
OFF = "Speculative decoding lets a cheap draft propose tokens that the target verifies. " * 2
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, seed=7)


class Injected(Exception):
    """An exception raised inside a step, as a failing backend or a bug would."""


def _call_site() -> str:
    """Which part of a request is running: prefill, resync, draft, verify or commit (read off the stack)."""
    names = set()
    frame = sys._getframe(1)
    while frame is not None:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    for name, part in (("commit_", "commit"), ("propose", "draft"), ("_resync", "resync"), ("_round", "verify"),
                       ("_run", "prefill")):
        if name in names:
            return part
    return "other"


class Faults:
    """Raises, with probability ``rate``, an exception before or after a hooked call: in the target's and the
    draft's steps and in the commit of accepted tokens. ``hits`` counts the faults raised per part of a request."""

    def __init__(self, dec: SpecDecoder, rate: float, seed: int):
        self.rng, self.rate, self.on = random.Random(seed), rate, False
        self.hits: dict[str, int] = {}
        self._undo = []
        for runner in (dec.target, dec.draft_runner):
            if runner is not None:
                self._wrap(runner, "step")
        self._wrap(decoder_module, "commit", rename="commit_")

    def _wrap(self, owner, name: str, rename: str | None = None) -> None:  # noqa: ANN001
        real = getattr(owner, name)

        def hooked(*a, **kw):  # noqa: ANN002, ANN003
            self._maybe_raise()
            out = real(*a, **kw)
            self._maybe_raise()  # the call's work is done, its caller never hears of it
            return out

        if rename:
            hooked.__code__ = hooked.__code__.replace(co_name=rename)
        setattr(owner, name, hooked)
        self._undo.append((owner, name, real))

    def _maybe_raise(self) -> None:
        if self.on and self.rng.random() < self.rate:
            part = _call_site()
            self.hits[part] = self.hits.get(part, 0) + 1
            raise KeyboardInterrupt if self.rng.random() < 0.5 else Injected(part)

    def remove(self) -> None:
        for owner, name, real in reversed(self._undo):
            if owner is decoder_module:
                setattr(owner, name, real)
            else:
                delattr(owner, name)  # the runner's own method again


@pytest.fixture
def fresh(bundles):
    dec = SpecDecoder.load(bundles["model"])
    yield dec
    dec.close()


def _reference(dec: SpecDecoder, prompt: str, params: SamplingParams) -> list[int]:
    return dec.generate(prompt, params, drafter="none", reuse_prefix=False).token_ids


def _fail_on_call(runner, n: int):  # noqa: ANN001, ANN202
    """Make the runner's n-th step from now raise KeyboardInterrupt (after it ran: its rows are written)."""
    real, calls = runner.step, [0]

    def step(*a, **kw):  # noqa: ANN002, ANN003
        out = real(*a, **kw)
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return out

    runner.step = step
    return lambda: delattr(runner, "step")


def test_an_interrupted_prefill_does_not_leave_its_unwritten_rows_to_be_reused(fresh):
    dec = fresh
    chunk = dec.manifest.prefill_chunk
    assert len(dec.encode_prompt(LONG)) > 3 * chunk  # a prefill of several steps
    want = _reference(dec, LONG, GREEDY)
    dec.generate(OTHER, GREEDY)
    undo = _fail_on_call(dec.target, 2)  # the prefill's second step: rows past that were never written for LONG
    with pytest.raises(KeyboardInterrupt):
        dec.generate(LONG, GREEDY)
    undo()
    res = dec.generate(LONG, GREEDY)
    shared = len(dec.encode_prompt(SHARED))
    assert res.stats.reused_tokens <= shared + 2 * chunk, "reused rows the interrupted prefill never wrote"
    assert res.token_ids == want


def test_an_interrupted_resync_does_not_leave_its_unwritten_rows_to_be_reused(fresh):
    dec = fresh
    want_long, want_off = _reference(dec, LONG, GREEDY), _reference(dec, OFF, GREEDY)
    paused = dec.stream(LONG, GREEDY, drafter="none")
    got = list(next(paused).token_ids)
    dec.generate(OFF, GREEDY)  # the caches now hold OFF's rows: LONG must rebuild its own on resuming
    undo = _fail_on_call(dec.target, 2)
    with pytest.raises(KeyboardInterrupt):
        for ev in paused:
            got += ev.token_ids
    undo()
    assert dec.generate(OFF, GREEDY).token_ids == want_off
    assert dec.generate(LONG, GREEDY).token_ids == want_long


def test_an_interrupted_draft_catch_up_leaves_the_draft_cache_for_what_was_written(fresh):
    """The draft's rows decide only what is proposed (the target verifies), but what the draft cache says it holds
    is true as well: a drafter that adopts it after an interrupted catch-up re-feeds what was overwritten."""
    dec = fresh
    dec.generate(OTHER, GREEDY, drafter="model")
    undo = _fail_on_call(dec.draft_runner, 2)
    with pytest.raises(KeyboardInterrupt):
        dec.generate(LONG, GREEDY, drafter="model")
    undo()
    cache, n_long = dec.draft_cache, len(dec.encode_prompt(LONG))
    written = 2 * dec.manifest.prefill_chunk + len(dec.encode_prompt(SHARED))
    assert cache.rows_for is None or len(cache.rows_for) <= written
    model = dec.make_drafter("model")

    assert model.catchup_plan(n_long + 1, np.asarray(dec.encode_prompt(LONG) + [1])) != []
    assert dec.generate(LONG, GREEDY, drafter="model").token_ids == _reference(dec, LONG, GREEDY)


def test_close_from_another_thread_waits_for_the_step_in_progress(fresh):
    dec = fresh
    stream = dec.stream(LONG, GREEDY, drafter="none")
    next(stream)
    real, entered, release = dec.target.step, threading.Event(), threading.Event()

    def slow_step(*a, **kw):  # noqa: ANN002, ANN003
        entered.set()
        release.wait(10)
        return real(*a, **kw)

    dec.target.step = slow_step
    errors: list[BaseException] = []

    def consume():
        try:
            for _ in stream:
                pass
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=consume)
    t.start()
    assert entered.wait(10)
    closer = threading.Thread(target=dec.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive(), "close() did not wait for the step in progress"
    release.set()
    t.join(10)
    closer.join(10)
    assert not closer.is_alive() and dec.target is None
    # the round in progress finished; a round after close (if the stream had not ended) says the decoder is closed
    assert not errors or (len(errors) == 1 and "closed" in str(errors[0])), errors


def test_faults_at_random_points_never_change_a_completed_request(fresh):
    """200 requests on prompts that share a prefix, two streams interleaved at a time, every drafter, greedy and
    seeded sampling; exceptions raised at random before and after steps and commits. Every request that completes
    gives the text plain decoding gives it alone."""
    dec = fresh
    cases = [(p, params) for p in (LONG, OTHER) for params in (GREEDY, SAMPLED)]
    want = {(p, params.temperature): _reference(dec, p, params) for p, params in cases}
    faults = Faults(dec, rate=0.008, seed=11)
    rng = random.Random(5)
    completed = failed = 0
    try:
        faults.on = True
        active: list = []
        started = 0
        while started < 200 or active:
            while started < 200 and len(active) < 2:
                prompt, params = rng.choice(cases)
                drafter = rng.choice(["auto", "model", "prompt-lookup", "hybrid", "none"])
                try:
                    stream = dec.stream(prompt, params, drafter=drafter, k=rng.choice([1, 3, 8]))
                except (KeyboardInterrupt, Injected):
                    failed += 1
                else:
                    active.append([stream, [], want[(prompt, params.temperature)]])
                started += 1
            item = rng.choice(active)
            ev = done = None
            try:
                ev = next(item[0])
            except StopIteration:
                done = True
            except (KeyboardInterrupt, Injected):
                done = False
            if done is None:
                item[1] += ev.token_ids
                continue
            active.remove(item)
            if done:
                assert item[1] == item[2], "a completed request's tokens differ from plain decoding's"
            completed, failed = completed + done, failed + (not done)
    finally:
        faults.on = False
        faults.remove()
    assert completed + failed == 200 and completed >= 50 and failed >= 30, (completed, failed)
    for part in ("prefill", "resync", "draft", "verify", "commit"):
        assert faults.hits.get(part, 0) >= 2, faults.hits
    for prompt, params in cases:  # and after it all, the decoder still serves every request exactly
        assert dec.generate(prompt, params).token_ids == want[(prompt, params.temperature)]


def test_real_interrupts_from_a_timer_never_change_a_completed_request(fresh):
    """SIGALRM raising KeyboardInterrupt wherever the interpreter is (Ctrl-C, a timeout), not only at the hooks
    above: 60 requests on the two prompts, the prefill often and a round seldom under a timer of 0.1-3 ms."""
    import signal

    dec = fresh
    want = {p: _reference(dec, p, GREEDY) for p in (LONG, OTHER)}
    rng = random.Random(3)

    def interrupt(signum, frame):  # noqa: ANN001, ARG001
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    completed = interrupted = 0
    try:
        for _ in range(60):
            prompt = rng.choice((LONG, OTHER))
            stream = dec.stream(prompt, GREEDY, drafter=rng.choice(["auto", "model", "prompt-lookup", "none"]))
            got: list[int] = []
            while True:
                try:
                    try:
                        if rng.random() < (0.3 if not got else 0.05):  # the prefill often, a round seldom
                            signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-4, 3e-3))
                        ev = next(stream)
                    finally:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                except StopIteration:
                    assert got == want[prompt], "a completed request's tokens differ from plain decoding's"
                    completed += 1
                    break
                except KeyboardInterrupt:  # inside the stream, or just after its step: either way it is dropped
                    stream.close()
                    interrupted += 1
                    break
                got += ev.token_ids
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert completed >= 5 and interrupted >= 5, (completed, interrupted)
    for prompt in (LONG, OTHER):
        assert dec.generate(prompt, GREEDY).token_ids == want[prompt]

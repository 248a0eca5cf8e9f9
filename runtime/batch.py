"""Requests decoding together: the rounds of a decoder loaded with ``max_batch`` N > 1.

The target's KV cache is a pool of N slots (a row-addressed bundle: every row of a step names its slot and
position, :meth:`..backends.ort.OrtRunner.step_rows`). A request joins the batch when its stream is first read and
waits, in arrival order, for a free slot; it takes the free slot whose rows agree longest with its prompt (a chat's
next turn finds its previous turn's rows), else the one used least recently. Each round then

1. runs one decode step for every request that has its first token: when one request decodes, the single-stream
   round (:meth:`SpecDecoder._round`: ``auto`` with the draft model and its k, as without a batch); when several
   do, one row-addressed step holding every request's last token and the drafts :func:`plan_rows` chose;
2. feeds the prompt of the request that joined first among those still feeding theirs: when several requests
   decode, in their step, as many of its rows as the prefill chunk ``P`` leaves beside theirs, where that is at
   least half of ``P`` (the step computes the logits of the decoding rows and of the prompt's last row only:
   ``step_rows(logits_rows=)``); else (their rows take more than half of ``P``, or one request decodes: its
   single-stream round runs steps of its own) one step of at most ``P`` rows of it after their round; when none
   decodes, its whole prompt.

Before each step of a prompt's prefill, rows another slot holds for a longer prefix of it (a shared system prompt)
are copied into its slot rather than computed (:meth:`Batch._borrow`; its draft's likewise at its first token).

So a new request's prompt goes in at half a chunk to a chunk per round, and a round that carries it costs the
requests decoding a step of ``P`` rows at most instead of their own step and one of ``P`` rows: time to first
token is traded against the others' time per token at one chunk per round.

In a round of several requests a request drafts by prompt lookup where its drafter is ``auto``, ``hybrid`` or
``prompt-lookup`` and lookup finds a match (its tokens cost rows of the shared step and nothing to draft); a
request whose drafter drafts with a model (``auto``, ``hybrid``, ``model``; greedy or keyed) and that lookup found
nothing for drafts with the draft model, in a draft slot of its own (the draft's cache is a pool of as many slots as
the target's): every such request's draws share one draft step per depth, the first also carrying each one's
catch-up (:meth:`Batch._draft_together`), to the depth the step costs predict pays most (0: none; at most
``BATCH_DRAFT_MAX``). :func:`plan_rows` then verifies a request's drafted tokens where the step's predicted tokens
per second, from the decoder's measured step costs and each request's running acceptance, gains by them; rows left
over in the chosen width carry more drafted tokens, then free one-token guesses (:meth:`SpecDecoder._free_guess`).
Trees and the classic sampler's model drafts stay with single-stream rounds.

Exactness: the kernels compute every row of a step of width >= 2 the same whatever else the step holds, and each
request keeps its own sampling state (its seed, its positions), so a request's tokens are bitwise those it gets
decoded alone, whichever requests shared its rounds.

Threads: every stream of the batch advances it. A request joins the waiting line under a lock of its own, at once
(the streams running rounds take the decoder's lock again round after round: behind it a join could wait for
seconds). Reading a stream whose request has no event waiting runs one round for every request (under the decoder's
lock, never across a yield); the events each round produces wait in their
request's queue, which its stream reads without the lock. A paused stream keeps its slot and its request keeps
decoding; a closed one leaves at once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .backends import copies_rows
from .cache_rows import CacheRows, common_prefix
from .drafters import Drafter, ModelDrafter, Proposal, SelfDrafter, feed, feed_plan
from .errors import OptionError
from .policy import Acceptance
from .request import Request, StreamEvent, commit
from .sampling import accept_argmax, verify_round

LOOKUP_DRAFTERS = ("auto", "hybrid", "prompt-lookup")  # drafters whose requests draft by prompt lookup in a batch
MODEL_DRAFTERS = ("auto", "hybrid", "model")  # ... and whose requests a draft model drafts for in a batch
BATCH_DRAFT_MAX = 4  # tokens a batched round drafts with the draft model at most
CATCH_UP_ALONG = 8  # committed tokens a request's draft may be behind and catch up on inside the batched draft step
# the predicted tokens per second a batched round's model drafts must add to run: a draft step of 1-4 rows costs a
# third of a target step and a round's host work is not priced (measured on 2 EPYC Zen 4 cores: drafting wherever it
# predicted any gain served 4 users 10-30 % slower than none, docs/benchmarks.md)
BATCH_DRAFT_MARGIN = 1.15


def draft_model_of(drafter: Drafter) -> ModelDrafter | None:
    """The draft model a request's drafter drafts with (None: none, or a self draft, which drafts alone)."""
    d = drafter if isinstance(drafter, ModelDrafter) else getattr(drafter, "model", None)
    return None if d is None or isinstance(d, SelfDrafter) else d


@dataclass(eq=False)
class Slot:
    """One sequence's place in the target's KV cache: the runner whose steps write there, what its rows hold and
    the request that holds it now (None: free; its rows stay, for a request that shares their prefix)."""

    index: int
    runner: Any  # a GraphRunner stepping in this slot (backends.SlotView over a pool; the runner itself for one)
    rows: CacheRows
    member: Member | None = None
    released: int = 0  # the batch's round count when it was last freed (the least recently used goes first)


@dataclass(eq=False)
class Member:
    """A request in the batch: its state, drafter, events not yet read and where its prompt's prefill stands."""

    req: Request
    drafter: Drafter
    k: int
    reuse_prefix: bool
    events: deque = field(default_factory=deque)
    slot: Slot | None = None
    plan: list[tuple[int, bool]] | None = None  # the prefill steps left (tokens, all_logits); None: decoding
    fed: int = 0  # prompt tokens whose rows are in the slot
    acceptance: Acceptance = field(default_factory=Acceptance)  # its lookup drafts' acceptance in batched rounds
    model_acceptance: Acceptance | None = None  # its draft model's in batched rounds (from the decoder's, at first)
    batched: dict[str, int] = field(default_factory=dict)  # rounds it ran in shared steps, per strategy
    t_join: float = 0.0
    t_first: float | None = None
    closed: bool = False  # its stream was closed (it leaves at the next round if it could not at once)

    @property
    def lookup(self) -> Any:
        """The prompt-lookup drafter its batched rounds propose with (None: it does not draft in a batch)."""
        if self.k == 0 or self.drafter.name not in LOOKUP_DRAFTERS:
            return None
        return getattr(self.drafter, "lookup", self.drafter)


def plan_rows(alphas: Sequence[float], drafted: Sequence[int], step_time: Callable[[int], float],
              budget: int) -> list[int]:
    """How many of each request's drafted tokens a batched round verifies. Request i drafted ``drafted[i]`` tokens,
    each accepted with probability ``alphas[i]`` once the ones before it were (so its j-th token adds
    ``alphas[i] ** j`` expected tokens to the one the round commits anyway); ``step_time(R)`` is the seconds of a
    step of R rows (the smallest width that holds them; ``inf`` past the widths). The tokens are taken in order of
    their expected gain while the round's expected tokens per second grows, with at most ``budget`` rows in all
    (each request's last token takes one)."""
    base = len(alphas)
    gains = sorted(((a ** (j + 1), i) for i, (a, n) in enumerate(zip(alphas, drafted)) for j in range(n)),
                   key=lambda g: -g[0])
    best_rate, best_r, expected = base / step_time(base), 0, float(base)
    for r, (g, _) in enumerate(gains[: max(0, budget - base)], 1):
        expected += g
        rate = expected / step_time(base + r)
        if rate > best_rate:
            best_rate, best_r = rate, r
    take = [0] * base
    for _, i in gains[:best_r]:
        take[i] += 1
    return take


class Batch:
    """The requests of one decoder decoding together (see the module docstring). Every method runs under the
    decoder's lock."""

    def __init__(self, dec: Any):  # a SpecDecoder (not imported: it imports this module)
        self.dec = dec
        self.waiting: deque[Member] = deque()  # joined, no slot yet (arrival order); under _joins
        self._joins = threading.Lock()  # a request joins under this lock alone, never waiting for a round
        self.members: list[Member] = []  # in a slot, in the order they took it
        self.rounds = 0
        self.sizes: dict[int, int] = {}  # rounds per number of requests decoding in them (a histogram)
        self.shared_prefill = 0  # rounds whose step also carried a prompt's rows
        self.borrowed = 0  # prompt rows copied from another slot's cache instead of computed (target)

    # ------------------------------------------------------------------ stream
    def run(self, req: Request, drafter: Drafter, k: int, reuse_prefix: bool) -> Iterator[StreamEvent]:
        dec = self.dec
        m = Member(req, drafter, k, reuse_prefix)
        joined = False
        try:
            with self._joins:  # not the round lock: the streams running rounds take that one again and again
                if dec.target is None:
                    raise OptionError("this decoder is closed; load the bundle again")
                m.t_join = time.perf_counter()
                self.waiting.append(m)
                joined = True
            while True:
                # Events are taken without the lock (only this thread takes from its queue; a round appends): a
                # stream with an event waiting yields it at once, never queued behind the next round.
                if m.events:
                    ev = m.events.popleft()
                    yield ev
                    if ev.finished:
                        return
                    continue
                with dec._lock:
                    if not m.events:  # still nothing: this stream runs the next round, for everyone
                        if dec.target is None:
                            raise OptionError("this decoder was closed while the stream was paused; load the "
                                              "bundle again")
                        self.round()
        finally:
            if joined:
                m.closed = True
                # A stream closed by the garbage collector can be finalized inside a round on this very thread:
                # without the lock its request is dropped at the start of the next round instead.
                if dec._lock.acquire(blocking=False):
                    try:
                        self._leave(m)
                    finally:
                        dec._lock.release()

    def _leave(self, m: Member) -> None:
        with self._joins:
            if m in self.waiting:
                self.waiting.remove(m)
        if m in self.members:
            self.members.remove(m)
        if m.slot is not None and m.slot.member is m:
            m.slot.member, m.slot.released = None, self.rounds

    # ------------------------------------------------------------------- round
    def round(self) -> None:
        """One round for every request in the batch: admit waiting ones to free slots, one decode step for those
        decoding, one prefill step (see the module docstring)."""
        self.rounds += 1
        with self._joins:
            closed = [m for m in (*self.waiting, *self.members) if m.closed]
        for m in closed:
            self._leave(m)
        self._admit()
        decoding = [m for m in self.members if m.plan is None and m.req.finish is None]
        feeding = [m for m in self.members if m.plan is not None]
        shared = False
        if len(decoding) == 1:
            self._single_round(decoding[0])
        elif decoding:
            shared = self._batched_round(decoding, feeding[0] if feeding else None)
        if decoding:
            self.sizes[len(decoding)] = self.sizes.get(len(decoding), 0) + 1
        if feeding and not shared:
            self._prefill(feeding[0], whole=not decoding)

    def _admit(self) -> None:
        free = [s for s in self.dec.slots if s.member is None]
        while free:
            with self._joins:
                if not self.waiting:
                    return
                m = self.waiting.popleft()
            req = m.req
            # the free slot whose rows agree longest with the prompt; else the least recently used
            slot = max(free, key=lambda s: ((s.rows.agree(req.tokens[: req.n]) if m.reuse_prefix else 0),
                                            -s.released))
            free.remove(slot)
            slot.member, m.slot, req.slot = m, slot, slot.index
            self.members.append(m)
            self._plan_prefill(m)
            caches = self.dec.draft_caches
            d = draft_model_of(m.drafter)
            if d is not None and len(caches) > 1 and d.cache is not caches[slot.index]:
                # its draft model drafts in the slot's own cache (the rows a previous turn there left, adopted)
                d.cache = caches[slot.index]
                d.runner, d.clock, d.rows = d.cache.runner, d.cache.clock, 0
            if not m.reuse_prefix and caches:  # the drafter starts cold
                caches[slot.index if len(caches) > 1 else 0].forget()

    def _plan_prefill(self, m: Member) -> None:
        """Where the prompt's prefill starts (the rows the slot holds already) and the steps it takes from there."""
        assert m.slot is not None
        req, rows = m.req, m.slot.rows
        start = rows.agree(req.tokens[: req.n]) if m.reuse_prefix else 0
        rows.writing(req.tokens, start)
        m.fed, req.stats.reused_tokens = start, start
        self._replan(m)

    def _borrow(self, m: Member) -> None:
        """Before a step of a request's prefill: where another slot's rows agree with its prompt further than the
        rows it has fed, copy them into its slot and go on after them. A system prompt or a conversation's prefix
        that another request holds is copied, not computed again: a row's K/V are a function of its tokens and
        position alone, whichever step and slot computed them. (Looked for at every step, not only when the request
        takes its slot: requests that arrive together take theirs before any has fed its prompt.)"""
        assert m.slot is not None and m.plan is not None
        target, req = self.dec.target, m.req
        if not m.reuse_prefix or not copies_rows(target):
            return
        prompt = req.tokens[: req.n]
        best, src = max(((s.rows.agree(prompt), s) for s in self.dec.slots if s is not m.slot),
                        key=lambda a: a[0], default=(0, None))
        if src is None or best <= m.fed:
            return
        target.copy_slot_rows(src.index, m.slot.index, m.fed, best)
        m.slot.rows.wrote(req.tokens, best)
        self.borrowed += best - m.fed
        req.stats.reused_tokens += best - m.fed
        m.fed = best
        self._replan(m)

    def _borrow_draft(self, m: Member) -> None:
        """When a request has its first token: the same for its draft model's cache, the rows another slot's draft
        cache holds for a longer prefix of its prompt, copied (its drafter adopts them at its first draft)."""
        assert m.slot is not None
        caches, runner = self.dec.draft_caches, self.dec.draft_runner
        if not m.reuse_prefix or draft_model_of(m.drafter) is None or len(caches) < 2 or not copies_rows(runner):
            return
        prompt, mine = m.req.tokens[: m.req.n], caches[m.slot.index]
        own = common_prefix(mine.rows_for, prompt)
        best, src = max(((common_prefix(c.rows_for, prompt), i) for i, c in enumerate(caches) if c is not mine),
                        default=(0, -1))
        if best <= own:
            return
        mine.forget()  # claims nothing while its rows are written (those before `own` agree already: kept)
        runner.copy_slot_rows(src, m.slot.index, own, best)
        mine.rows_for = prompt[:best]  # the request's committed tokens: never rewritten, so a view will do

    def _replan(self, m: Member) -> None:
        """The prefill steps from the rows already fed on."""
        assert m.slot is not None
        m.plan = feed_plan(m.slot.runner, m.req.n - m.fed, m.fed, self.dec.manifest.prefill_chunk,
                           lone_last=self.dec.width1_exact)

    def _prefill(self, m: Member, whole: bool) -> None:
        """One step of a request's prefill (all of them if ``whole``); the last gives its first token."""
        assert m.slot is not None and m.plan is not None
        req, slot = m.req, m.slot
        while m.plan:
            if not slot.rows.holds(req.tokens, m.fed):  # its rows were written over (a timing): start again
                self._plan_prefill(m)
            self._borrow(m)
            take, all_logits = m.plan.pop(0)
            logits = slot.runner.step(req.tokens[m.fed: m.fed + take], m.fed, all_logits=all_logits)
            last = not m.plan
            self._fed(m, take, (logits[take - 1] if all_logits else logits[0]) if last else None)
            if last or not whole:
                return

    def _emit(self, m: Member, ev: StreamEvent) -> None:
        st = m.req.stats
        if m.t_first is not None:
            st.decode_s = time.perf_counter() - m.t_first
        if ev.finished:
            single = st.rounds - sum(m.batched.values())
            alone = m.drafter.strategy_rounds() or ({m.drafter.name: single} if single else {})
            st.strategies = {**alone, **m.batched}
            self._leave(m)  # its slot is free for the next request; its events wait for its stream
        m.events.append(ev)

    # ------------------------------------------------------------------ decode
    def _single_round(self, m: Member) -> None:
        """The one request decoding: today's single-stream round, its drafter's full choice."""
        dec, req = self.dec, m.req
        if not self._holds(m):
            dec._resync(req, m.drafter)
        self._emit(m, dec._round(req, m.drafter, m.k))

    def _holds(self, m: Member) -> bool:
        assert m.slot is not None
        return m.slot.rows.holds(m.req.tokens, m.req.n - 1)

    def _batched_round(self, ms: list[Member], feeder: Member | None = None) -> bool:
        """One row-addressed step for several requests: each one's last token and the drafted tokens plan_rows
        chose (then free guesses in rows the width has left), verified and committed per request; and, with a
        ``feeder`` (a request feeding its prompt), as many of its prompt's rows as the prefill chunk leaves, its first
        token if they are the last. Whether the feeder's rows rode in the step."""
        dec = self.dec
        target, costs = dec.target, dec._costs
        for m in ms:
            if not self._holds(m):
                dec._resync(m.req, m.drafter)
        t0 = time.perf_counter()
        props = []
        for m in ms:
            req, look = m.req, m.lookup
            room = min(m.k, req.params.max_new_tokens - req.generated - 1)
            props.append(look.propose(req.tokens[: req.n], room, req.params, req.rng) if look is not None and room > 0
                         else Proposal(np.zeros(0, dtype=np.int64), None))
        widths = sorted(w.T for w in target.entry.widths if w.L == w.T and w.T >= target.min_width)
        budget = widths[-1]

        depth = sum(m.req.n for m in ms) // len(ms)  # the step's rows attend over their own contexts: their mean

        def step_time(rows: int) -> float:
            if costs is not None:
                return costs.verify_time(rows, depth)
            fits = [t for t in widths if t >= rows]  # no timings (no request drafts): the width's rows
            return float(fits[0]) if fits else float("inf")

        drafted = self._draft_model_rows(ms, props, step_time)  # members the draft model drafted for
        alphas = [m.model_acceptance.alpha if i in drafted and m.model_acceptance is not None else m.acceptance.alpha
                  for i, m in enumerate(ms)]
        take = plan_rows(alphas, [len(p.tokens) for p in props], step_time, budget)
        drafted_members = {ms[i] for i in drafted}
        rows = len(ms) + sum(take)
        width = min(t for t in widths if t >= rows)
        spare = width - rows
        for i in sorted(range(len(ms)), key=lambda i: -ms[i].acceptance.alpha):  # more drafted tokens, free
            more = min(spare, len(props[i].tokens) - take[i])
            take[i], spare = take[i] + more, spare - more
        guessed = [False] * len(ms)
        for i, m in enumerate(ms):  # then a free one-token guess for a request with nothing to verify
            if take[i] == 0 and spare > 0 and m.req.params.max_new_tokens - m.req.generated > 1:
                props[i], take[i], guessed[i], spare = dec._free_guess(m.req), 1, True, spare - 1
        ids, slots, positions = [], [], []
        for m, p, n in zip(ms, props, take):
            req = m.req
            ids += [int(req.tokens[req.n - 1]), *p.tokens[:n].tolist()]
            slots += [req.slot] * (n + 1)
            positions += range(req.n - 1, req.n + n)
        greedy = all(m.req.params.greedy for m in ms) and target.has_argmax
        for m in ms:
            m.slot.rows.writing(m.req.tokens, m.req.n - 1)
        decode_rows, fed, last = len(ids), 0, False
        # the prompt rides along where the chunk leaves it at least half its rows (else its own step: a chunk)
        if feeder is not None and 2 * decode_rows <= self.dec.manifest.prefill_chunk and target.device == "cpu":
            req, slot = feeder.req, feeder.slot
            assert slot is not None
            if not slot.rows.holds(req.tokens, feeder.fed):  # its rows were written over (a timing): start again
                self._plan_prefill(feeder)
            self._borrow(feeder)
            fed = min(self.dec.manifest.prefill_chunk - decode_rows, req.n - feeder.fed)
            last = feeder.fed + fed == req.n
            ids += req.tokens[feeder.fed: feeder.fed + fed].tolist()
            slots += [req.slot] * fed
            positions += range(feeder.fed, feeder.fed + fed)
        t1 = time.perf_counter()
        if fed:  # logits for the decoding rows and the prompt's last row only (its first token's)
            out = target.step_rows(ids, slots, positions, ids_only=greedy and not last,
                                   logits_rows=[*range(decode_rows), *([len(ids) - 1] if last else [])])
            greedy = greedy and not last
        else:
            out = target.step_rows(ids, slots, positions, ids_only=greedy)
        t2 = time.perf_counter()
        if costs is not None and not fed:
            costs.observe_target(len(ids), t2 - t1, depth)
        at = 0
        for m, p, n, guess in zip(ms, props, take, guessed):
            req, st = m.req, m.req.stats
            drafts = p.tokens[:n]
            rows_out = out[at: at + n + 1]
            at += n + 1
            acc, nxt = (accept_argmax(rows_out, drafts) if greedy else
                        verify_round(rows_out, drafts, None, req.params, req.rng, req.n))
            model = draft_model_of(m.drafter) if m in drafted_members else None
            if model is not None:
                model.commit(0 if guess else acc)  # its cache keeps the rows of the drafts accepted
            ev = commit(req, dec.manifest.tokenizer.eos_ids, [*drafts[:acc].tolist(), nxt])
            m.slot.rows.wrote(req.tokens, req.n - 1)
            if not guess:
                (m.model_acceptance if model is not None else m.acceptance).update(n, acc)
            st.record_round(0 if guess else n, 0 if guess else min(acc, len(ev.token_ids)),
                            guessed=acc if guess else None)
            name = ("batch-none" if not n or guess else "batch-model" if model is not None
                    else "batch-prompt-lookup")
            m.batched[name] = m.batched.get(name, 0) + 1
            st.time_draft_s += (t1 - t0) / len(ms)
            st.time_verify_s += t2 - t1
            self._emit(m, ev)
        t3 = time.perf_counter()
        for m in ms:
            m.req.stats.time_host_s += (t3 - t2) / len(ms)
        if fed:
            self.shared_prefill += 1
            self._fed(feeder, fed, out[decode_rows] if last else None)
            if not last:
                self._replan(feeder)
        return bool(fed)

    def _draft_model_rows(self, ms: list[Member], props: list[Proposal], step_time: Callable[[int], float]) -> set[int]:
        """Draft with the draft model, in shared draft steps, for the requests of a batched round that lookup found
        nothing for and whose drafter drafts with a model (greedy or keyed: their output never depends on the draft),
        as many tokens each as raise the round's predicted tokens per second (none without timings); their
        proposals replace ``props``'. The indices of the requests drafted for."""
        dec, costs = self.dec, self.dec._costs
        if costs is None or len(dec.draft_caches) < 2 or not costs.draft_widths:
            return set()
        chosen = []
        along, apart = 0, 0.0  # catch-up rows the first draft step carries; seconds of the catch-ups fed apart
        for i, m in enumerate(ms):
            req = m.req
            room = min(m.k, req.params.max_new_tokens - req.generated - 1, BATCH_DRAFT_MAX)
            model = draft_model_of(m.drafter)
            if (len(props[i].tokens) or room < 1 or m.drafter.name not in MODEL_DRAFTERS or model is None
                    or not (req.params.greedy or req.params.sampler == "keyed")):
                continue
            tokens = req.tokens[: req.n]
            behind = req.n - 1 - model._adoptable(tokens)
            if behind > CATCH_UP_ALONG:  # far behind: its own catch-up steps first
                # priced as prefill chunks (not the cheapest plan feed will find: that search, every round for every
                # request far behind, cost 0.1-0.35 ms each)
                chunk = dec.manifest.prefill_chunk
                rest = [behind % chunk] if behind % chunk else []
                seconds = costs.catchup_time([chunk] * (behind // chunk) + rest)
                if seconds > 0.25 * step_time(len(ms)):
                    # a draft that has not seen the prompt (150 tokens of the 0.5B Qwen: 0.26 s on 2 cores, rounds'
                    # worth of time): it catches up when its request decodes alone
                    continue
                apart += seconds
            else:
                along += max(0, behind)
            if m.model_acceptance is None:
                m.model_acceptance = Acceptance()
                m.model_acceptance.reseed(costs.model_acceptance.alpha, 4.0)
            chosen.append((i, room))
        if not chosen:
            return set()
        widths = sorted(costs.draft_widths)

        def draft_step(rows: int) -> float:
            fits = [t for t in widths if t >= rows]
            return costs.draft_widths[fits[0]] if fits else float("inf")

        rows = len(ms) + sum(len(p.tokens) for p in props)
        tokens = float(len(ms))
        best_k, best_rate = 0, tokens / step_time(rows)
        for k in range(1, max(room for _, room in chosen) + 1):
            takers = [i for i, room in chosen if room >= k]
            rows += len(takers)
            tokens += sum(ms[i].model_acceptance.alpha ** k for i in takers)  # type: ignore[union-attr]
            seconds = step_time(rows) + apart + draft_step(len(chosen) + along) + (k - 1) * draft_step(len(chosen))
            if tokens / seconds > best_rate * (1.0 if best_k else BATCH_DRAFT_MARGIN):
                best_k, best_rate = k, tokens / seconds
        if not best_k:
            return set()
        drafts = self._draft_together([(ms[i], min(room, best_k)) for i, room in chosen])
        for (i, _), d in zip(chosen, drafts):
            props[i] = Proposal(d, None)
        return {i for i, _ in chosen}

    def _draft_together(self, todo: list[tuple[Member, int]]) -> list[np.ndarray]:
        """k draft tokens for each (request, k), every request in its draft slot: the first draw's step carries each
        one's catch-up (up to CATCH_UP_ALONG tokens; a request further behind catches up in its own steps first),
        then one row per request still drafting per step (the decision never hands it one further behind)."""
        dec = self.dec
        draft = dec.draft_runner
        models = [draft_model_of(m.drafter) for m, _ in todo]
        ids: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        last_rows = []
        for (m, _), d in zip(todo, models):
            req, n = m.req, m.req.n
            assert d is not None and m.slot is not None
            tokens = req.tokens[:n]
            d._adopt(tokens)
            if n - 1 - d.rows > CATCH_UP_ALONG:  # a long way behind (its prompt): its own steps
                feed(d.runner, tokens[d.rows: n - 1], d.rows, dec.manifest.prefill_chunk, d.clock)
                d.rows = n - 1
                d.cache.rows_for = tokens[: n - 1]
            ids += tokens[d.rows: n].tolist()
            slots += [m.slot.index] * (n - d.rows)
            positions += range(d.rows, n)
            last_rows.append(len(ids) - 1)
        out = draft.step_rows(ids, slots, positions, logits_rows=last_rows)
        drafts = [np.zeros(k, dtype=np.int64) for _, k in todo]
        for j in range(max(k for _, k in todo)):
            live = [i for i, (_, k) in enumerate(todo) if k > j]
            if j:
                out = draft.step_rows([int(drafts[i][j - 1]) for i in live], [todo[i][0].req.slot for i in live],
                                      [todo[i][0].req.n - 1 + j for i in live], logits_rows=list(range(len(live))))
            for r, i in enumerate(live if j else range(len(todo))):
                if todo[i][1] > j:
                    m = todo[i][0]
                    drafts[i][j] = models[i].draw(out[r], m.req.params, m.req.n + j)  # type: ignore[union-attr]
        for (m, k), d in zip(todo, models):
            d.drafted_together(m.req.tokens[: m.req.n], k)  # type: ignore[union-attr]
        return drafts

    def _fed(self, m: Member, n: int, logits: np.ndarray | None) -> None:
        """n more of a request's prompt rows are in its slot; with the last one's logits, its first token."""
        assert m.slot is not None
        req = m.req
        m.fed += n
        m.slot.rows.wrote(req.tokens, m.fed)
        if logits is None:
            return
        m.plan = None
        self._borrow_draft(m)
        ev = self.dec._first_token(req, logits)
        m.t_first = time.perf_counter()
        req.stats.ttft_s = m.t_first - m.t_join
        self._emit(m, ev)

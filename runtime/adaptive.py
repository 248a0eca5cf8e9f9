"""Speculation that knows when it pays: a measured cost model and a per-round choice of drafter.

Each round the :class:`AutoDrafter` predicts tokens per second for every option it has —

    plain:               1 / t_v(1)
    prompt lookup (m):   E(alpha_lookup, m) / t_v(m+1)                       (drafting is free)
    draft model (k):     E(alpha_model, k) / (k * t_d + t_v(k+1))
    E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)   tokens committed per round

— with t_v(n) the measured time of a target step at the width n tokens run in, t_d of one
draft step, and alpha the running per-token acceptance of each drafter — and proposes with
the best. ``hybrid`` takes prompt lookup whenever it has a match and the draft model
otherwise. When no speculative option beats plain decoding the round is plain ("auto-off");
after ``FIRST_PROBE`` plain rounds of a request the best option under an optimistic acceptance is
tried (if even that would not pay, nothing is), and the gap to the next probe doubles (it starts
at ``probe_every`` again after a round that drafted). A draft-model probe is ``PROBE_ROUNDS``
rounds of at most ``PROBE_K`` tokens, past the confidence gate, extended while its drafts all pass (each
such round twice as long as the last) and ended where the estimate picks prompt lookup. The
draft model's catch-up (the committed tokens it has not seen, priced per step of the plan
``feed`` will run: prefill chunks for a prompt, a single step for a round's leftover token) is
charged to the round that would use it (spread over the runs of model rounds seen so far where the
request copies its context, over the request where it does not), and a model round must be predicted
``MODEL_MARGIN`` faster than the alternatives (``PROMPT_MARGIN`` where it would first catch the draft up on the
prompt, a re-probe's too). In a gap between two lookup matches of a request that copies its
context, the options are weighed by the seconds they save rather than by tokens per second: what a round commits
past the gap (its expected length learned from the request's earlier gaps) lookup would have committed at the
request's own pace (``decide``'s ``gap`` and ``pace``). Prompt lookup is asked every round, so what it would
have proposed in rounds it did not run is checked against the committed text too: its acceptance
(and how much of the request it matches) is learned from every round. The step costs and the
draft's acceptance live in the decoder's :class:`CostModel`, so a request starts from what the
earlier ones measured; but until its own draft rounds speak, a request's prior for the draft is what its
target's confidence predicts (:class:`TargetSplit`: the share of its tokens the target was sure of, from the
top-1 probabilities the decoder passes for its first ``CONF_WINDOW`` tokens), not what other kinds of text left.

Inside a model round drafting stops early when the draft's top probability falls below a
threshold learned online: acceptance is tracked per confidence bin, and a token is drafted
only while its bin's acceptance beats the break-even ratio (t_d + marginal verify cost) / t_v(1).
The draw that stops a round is not verified by it, but when the round passes whole, the target's
next token tells whether it would have passed: the bins learn from those too.

None of this touches the acceptance rule: it only changes which tokens are proposed, so
greedy output and the sampled distribution stay exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .drafters import EMPTY, ModelDrafter, PromptLookupDrafter, Proposal

SPEC_MODES = ("auto", "hybrid")


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """E[tokens committed per round] = (1 - alpha^(k+1)) / (1 - alpha): accepted drafts + the target's token,
    for i.i.d. per-token acceptance alpha (Leviathan et al. 2023, eq. 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance alpha must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class CostModel:
    """What auto knows about one decoder, kept across its requests: seconds per target step at each width and
    per draft step, refreshed from every round, and what the draft model's tokens have passed (per token and
    per confidence). A request is often too short to learn the draft's acceptance from a 50 % prior (a JSON answer
    of 48 tokens ended before auto had tried the 0.5B draft once, where it runs 1.16-1.33x plain), so each
    request starts from the earlier ones' estimate (at the weight of ``AutoDrafter.CARRY_WEIGHT`` tokens), which
    its own rounds then move.

    Times are a shape times the machine's ``speed``: the seconds of a target step at width T are ``speed *
    target[T]``, of a draft step ``speed * draft``. Every target step moves ``speed`` (an exponential moving average
    of its ratio to the prediction, at ``decay``), so the model follows a device that heats up or a shared machine
    that changes phase, and widths not run lately move with it; the shape (one width against another) learns at
    ``shape_decay``, slowly. Averaged per width alone, the widths auto had not run for a while kept the speed of
    another phase: a run on a shared VM ended with T=1 at 26.8 ms against T=2 at 24.5 (their fastest, 21.6 and
    22.1), so plain looked slower than a round that drafts one token. The draft's step and catch-up keep their own
    averages (at ``decay``: they include host work the load-time timing leaves out), relative to ``speed``.
    """

    target: dict[int, float]  # width T -> seconds of one target step, at speed 1 (the load-time timing's)
    draft: float | None = None  # seconds of one 1-token draft step, at speed 1
    decay: float = 0.9
    draft_widths: dict[int, float] = field(default_factory=dict)  # width T -> seconds of one draft step (its prefill)
    speed: float = 1.0  # the machine's seconds now against a second of the shape's (running)
    shape_decay: float = 0.98
    catchup_scale: float = 1.0  # catch-ups' measured time over their prediction (running)
    guess_alpha: float = 0.0  # how often a plain round's free one-token guess is confirmed (invariant decoders)
    model_tried: bool = False  # whether auto has run a draft-model round on this decoder yet
    model_streak: float = 32.0  # rounds a run of draft-model rounds lasts before another kind (running; prior: long)
    model_acceptance: Acceptance = field(default_factory=lambda: Acceptance())
    gate: ConfidenceGate = field(default_factory=lambda: ConfidenceGate())
    target_split: TargetSplit = field(default_factory=lambda: TargetSplit())

    def verify_time(self, n: int) -> float:
        """Time of the target step that n tokens run in (the smallest width >= n)."""
        fits = [t for t in self.target if t >= n]
        return self.speed * self.target[min(fits)] if fits else float("inf")

    def observe_target(self, n: int, seconds: float) -> None:
        """A target step of n tokens took ``seconds``: the speed takes (1 - decay) of its log-ratio to the
        prediction, the width's shape (1 - shape_decay) of what is left."""
        fits = [t for t in self.target if t >= n]
        if fits and seconds > 0:
            w = min(fits)
            self.speed *= (seconds / (self.speed * self.target[w])) ** (1 - self.decay)
            self.target[w] *= (seconds / (self.speed * self.target[w])) ** (1 - self.shape_decay)

    def _catchup_prediction(self, plan: list[int]) -> float:
        steps = 0.0
        for take in plan:
            fits = [t for t in self.draft_widths if t >= take]
            if take == 1 or not fits:
                steps += take * (self.draft or 0.0)
            else:
                steps += self.draft_widths[min(fits)]
        return self.speed * steps

    def catchup_time(self, plan: list[int]) -> float:
        """Time for the draft model to catch up on the committed tokens it has not seen, fed in the steps of
        ``plan`` (tokens per step: ``ModelDrafter.catchup_plan``). Priced per step, not per token: a prompt goes
        in prefill chunks (~5 ms a token for the 0.5B draft on 2 cores) and the one token a fully accepted round
        leaves behind in a single step (~15 ms), so a per-token average of the two mispriced both. The plan's
        last step is also the round's first draw, which the round's draft steps are charged for already: the
        catch-up costs the plan less one draft step."""
        if not plan:
            return 0.0
        return max(0.0, self.catchup_scale * self._catchup_prediction(plan) - self.draft_time())

    def observe_catchup(self, plan: list[int], seconds: float) -> None:
        predicted = self._catchup_prediction(plan)
        if predicted > 0:
            self.catchup_scale = self.decay * self.catchup_scale + (1 - self.decay) * seconds / predicted

    def observe_draft(self, seconds_per_step: float) -> None:
        shape = seconds_per_step / self.speed
        self.draft = shape if self.draft is None else self.decay * self.draft + (1 - self.decay) * shape

    def draft_time(self) -> float:
        """Seconds of one 1-token draft step now (0 without a draft)."""
        return self.speed * (self.draft or 0.0)

    # -- predicted tokens per second ------------------------------------------------
    def observe_guess(self, confirmed: int) -> None:
        """A plain round's free guess was confirmed (1) or not (0): plain decoding yields 1 + that per step."""
        self.guess_alpha = self.decay * self.guess_alpha + (1 - self.decay) * float(confirmed)

    def rate_plain(self) -> float:
        return (1.0 + self.guess_alpha) / self.verify_time(1)

    def rate_lookup(self, alpha: float, m: int) -> float:
        return expected_tokens_per_round(alpha, m) / self.verify_time(m + 1)

    def rate_model(self, alpha: float, k: int, overhead: float = 0.0) -> float:
        """overhead: one-off seconds this round pays before drafting (the draft's catch-up of a prompt).

        A round whose k drafts all pass (chance alpha^k) leaves the draft one token behind (the last draft, which
        it proposed but never fed), so the next round's first step is wider (``behind_one``): priced here, or k = 1
        looks twice as cheap as it runs (auto then chose k = 1-2 on a JSON prompt: 28.6-31.6 tok/s where a fixed
        k = 4 ran 33.4)."""
        if self.draft is None:
            return 0.0
        draft_steps = k + alpha ** k * self.behind_one()
        return expected_tokens_per_round(alpha, k) / (draft_steps * self.draft_time() + self.verify_time(k + 1)
                                                      + overhead)

    def behind_one(self) -> float:
        """Draft steps (of one token) that a round leaving the draft one token behind adds to the next round: that
        token rides with the first draw in the cheapest step of two tokens or more (``ModelDrafter.propose``), less
        the single step the first draw takes anyway. A bundle whose draft has no such width: one more step."""
        if not self.draft:
            return 1.0
        two = min([c for t, c in self.draft_widths.items() if t >= 2] + [2 * self.draft])
        return max(0.0, two - self.draft) / self.draft

    def break_even_acceptance(self, k_max: int) -> float:
        """Acceptance a draft token needs to pay for itself: (t_d + marginal verify time) / t_v(1)."""
        marginal = max(0.0, (self.verify_time(k_max + 1) - self.verify_time(1)) / max(k_max, 1))
        return (self.draft_time() + marginal) / self.verify_time(1)


@dataclass
class Acceptance:
    """Running per-token acceptance of one drafter: accepted tokens are successes, the first rejection
    a failure (tokens after it are unobserved) — the geometric MLE, with decay and a weak prior."""

    successes: float = 1.0
    failures: float = 1.0
    decay: float = 0.95

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    def limit(self, weight: float) -> None:
        """Keep the estimate but at most ``weight`` tokens of evidence behind it (a new request's start)."""
        total = self.successes + self.failures
        if total > weight:
            self.successes, self.failures = self.successes * weight / total, self.failures * weight / total

    def reseed(self, alpha: float, weight: float) -> None:
        """The estimate ``alpha`` at ``weight`` tokens of evidence (a request's prior from its target's confidence)."""
        self.successes, self.failures = alpha * weight, (1.0 - alpha) * weight

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.successes = self.decay * self.successes + accepted
        self.failures = self.decay * self.failures + (1.0 if accepted < drafted else 0.0)


@dataclass
class TargetSplit:
    """How often the draft's token passes where the target is sure of its next token (top-1 probability above
    ``SURE``) and where it is not, learned from the verify rows of draft-model rounds. The target's confidence is
    there in every round, plain ones too, so a request's share of sure tokens predicts the draft's acceptance on it
    before the draft has run (``predict``). Measured on the Qwen pair (teacher-forced over the suites' answers,
    docs/benchmarks.md): where the 1.5B target was more than 90 % sure, the 0.5B draft agreed 89-100 % of the time,
    elsewhere mostly 60-70 %; JSON answers had 85-94 % sure tokens, chat answers 27-33 %.
    Prior: those rates, worth ``PRIOR`` tokens each."""

    SURE = 0.9
    PRIOR = 4.0
    agreed: np.ndarray = field(default_factory=lambda: np.array([0.65, 0.95]) * TargetSplit.PRIOR)
    seen: np.ndarray = field(default_factory=lambda: np.full(2, TargetSplit.PRIOR))

    def record(self, confs: list[float], accepted: int) -> None:
        """Verify rows 0.. of a draft-model round, with their target top-1 probabilities ``confs``: the first
        ``accepted`` drafts passed, the next one (if any) did not."""
        for i, c in enumerate(confs[: accepted + 1]):
            b = int(c > self.SURE)
            self.seen[b] += 1
            self.agreed[b] += 1.0 if i < accepted else 0.0

    def predict(self, sure_share: float) -> float:
        """The draft's expected acceptance on text with this share of sure tokens."""
        lo, hi = self.agreed / self.seen
        return float(sure_share * hi + (1.0 - sure_share) * lo)


@dataclass
class ConfidenceGate:
    """Acceptance per bin of the draft's top probability, learned online; ``keep(conf)`` says whether a
    token drafted at that confidence is expected to pay (acceptance above the break-even ratio).

    Prior: each bin's own confidence (a draft that is 95 % sure is taken to be right 95 % of the time), worth two
    tokens. A flat 50 % prior sat below the break-even ratio (~0.6 on 2 cores), so every draw after a round's
    first was dropped and the bins that would have learned better never saw a token: the 0.5B draft ran one token
    a round for the first ~14 rounds of a request."""

    bins: int = 10
    accepted: np.ndarray = field(default_factory=lambda: 2.0 * (np.arange(10) + 0.5) / 10)  # prior: the bin's centre
    seen: np.ndarray = field(default_factory=lambda: np.full(10, 2.0))

    def _bin(self, conf: float) -> int:
        return min(int(conf * self.bins), self.bins - 1)

    def acceptance(self, conf: float) -> float:
        b = self._bin(conf)
        return float(self.accepted[b] / self.seen[b])

    def record(self, confs: list[float], accepted: int) -> None:
        """The first ``accepted`` tokens were accepted, the next one (if any) rejected."""
        for i, c in enumerate(confs[: accepted + 1]):
            b = self._bin(c)
            self.seen[b] += 1
            self.accepted[b] += 1.0 if i < accepted else 0.0


@dataclass
class Decision:
    kind: str  # "none" | "prompt-lookup" | "model"
    k: int
    rate: float  # predicted tokens per second
    tokens: float = 1.0  # predicted tokens committed by the round (its seconds: tokens / rate)


# A draft-model round must be predicted this much faster than the alternatives to be chosen. Its prediction carries
# more error than the others' (draft step noise, sampling on the host, a cache shared with the target): on the Qwen
# chat prompt a model round predicted level with plain ran 5 % slower, and auto lost 5 % there by taking it.
MODEL_MARGIN = 1.04
# ... and this much where the round would first catch the draft up on the request's prompt: an investment of
# ~0.2-0.6 s made once, on what earlier requests said, before this one has shown whether lookup will serve it (at
# MODEL_MARGIN an edit after code prompts paid it in its first round, then ran on lookup). Values from 1.08 to 1.12
# behave alike; measured: edit 0.94x, chat 1.09x the best fixed configuration with a cold draft (docs/benchmarks.md).
PROMPT_MARGIN = 1.1


def decide(costs: CostModel, alpha_lookup: float, lookup_len: int, alpha_model: float | None, k_max: int,
           mode: str = "auto", model_overhead: float = 0.0, horizon: int | None = None,
           gap: float = float("inf"), pace: float = 0.0, margin: float = MODEL_MARGIN) -> Decision:
    """The option with the highest predicted tokens/s (pure function of the cost model and the estimates).

    auto: best of plain, prompt lookup (the first 1..lookup_len tokens of its match) and the draft model at
    k = 1..k_max (charged ``model_overhead`` seconds of catch-up: to this round alone, or, given the ``horizon`` of
    tokens the request may still generate, spread over them — the catch-up is paid once and serves every later
    model round: rate = horizon / (overhead + horizon / rate without it)). hybrid: prompt lookup when it has a
    match, else the draft model's best k (never plain).

    ``gap`` (expected tokens until prompt lookup matches again, where it has no match now) and ``pace`` (the
    tokens/s the request runs at): the highest tokens/s is the best choice when the next round faces the same
    options, as through a chat answer. A copying request's gap between two lookup matches does not: what a round
    commits past the gap, lookup would have committed at the request's pace. So each option is scored by the time
    it saves: its tokens within the gap at the best rate now, those past it at the pace, less its seconds. With no
    gap (or a pace below the best rate) that is the fastest option again.

    ``margin``: how much faster a draft-model round must be predicted than the alternatives (``MODEL_MARGIN``,
    ``PROMPT_MARGIN``).
    """
    options = [Decision("none", 0, costs.rate_plain(), 1.0 + costs.guess_alpha)]
    options += [Decision("prompt-lookup", m, costs.rate_lookup(alpha_lookup, m),
                         expected_tokens_per_round(alpha_lookup, m)) for m in range(1, lookup_len + 1)]
    if alpha_model is not None and costs.draft is not None:
        for k in range(1, k_max + 1):
            e = expected_tokens_per_round(alpha_model, k)
            if horizon is None or model_overhead <= 0.0:
                options.append(Decision("model", k, costs.rate_model(alpha_model, k, model_overhead), e))
            else:
                r0 = costs.rate_model(alpha_model, k)
                options.append(Decision("model", k, horizon / (model_overhead + horizon / r0) if r0 > 0 else 0.0, e))
    if mode == "hybrid":
        lookup = [o for o in options if o.kind == "prompt-lookup"]
        model = [o for o in options if o.kind == "model"]
        pool = lookup or model or options
        return max(pool, key=lambda o: o.rate)

    def discount(o: Decision) -> float:  # a model round's predictions are discounted by its margin
        return margin if o.kind == "model" else 1.0

    best = max(options, key=lambda o: o.rate / discount(o))
    rate = best.rate / discount(best)
    if gap == float("inf") or rate <= 0:
        return best
    pace = max(pace, rate)

    def saves(o: Decision) -> float:  # seconds saved against the best rate now
        worth = o.tokens / discount(o)
        return min(worth, gap) / rate + max(0.0, worth - gap) / pace - o.tokens / o.rate

    return max((o for o in options if o.rate > 0), key=saves)


class AutoDrafter:
    """Chooses plain, prompt lookup or the draft model (with its k) every round; see the module docstring."""

    OPTIMISTIC_ALPHA = 0.9  # what a re-probe assumes: is the option worth trying if its drafts were good?
    HORIZON_CAP = 256  # tokens a request is assumed to still run at most, when spreading the draft's catch-up
    CARRY_WEIGHT = 8.0  # tokens of evidence a request inherits about the draft's acceptance
    FIRST_PROBE = 4  # plain rounds before a request's first re-probe (then the gap doubles; probe_every after drafting)
    PROBE_ROUNDS = 3  # rounds a draft-model probe runs before its acceptance decides again
    PROBE_K = 2  # a probe's draft length (at most): enough to measure acceptance, cheap where the draft fails
    # share of a request's text its lookup matched from which its model runs are taken to be cut by lookup rounds
    # (the catch-up then spread over the runs learned, ``_streak_priced``; below it, over the request)
    COPYING = 0.2
    COPY_TOKENS = 24  # tokens before a request's share says it does not copy (a summary's first ones may not match)
    # ... and until then, the runs a catch-up is spread over are taken to be at least this share of the request
    UNSURE_SHARE = 0.2
    CONF_TOKENS = 4  # target confidences a request needs before their share of sure ones sets the draft's prior
    # ... and the request's first tokens whose confidences the decoder computes (a softmax over the vocabulary per
    # row: ~0.13 ms for Qwen's 151,936 logits, so not every round's; see ``wants_confidence``)
    CONF_WINDOW = 64
    clock = staticmethod(time.perf_counter)  # the request's pace is timed with it (tests set their own)

    def __init__(self, costs: CostModel, lookup: PromptLookupDrafter, model: ModelDrafter | None,
                 mode: str = "auto", probe_every: int = 16):
        if mode not in SPEC_MODES:
            raise ValueError(f"mode must be one of {SPEC_MODES}, got {mode!r}")
        self.name = mode
        self.costs, self.lookup, self.model, self.mode = costs, lookup, model, mode
        self.probe_every = probe_every
        # The draft's acceptance is the decoder's, carried over from its earlier requests at the weight of a few
        # tokens: a JSON request then starts drafting at once, and a chat request after it stops within a few
        # rounds (carried whole, ~70 tokens of code's 0.9 kept auto drafting through a third of a chat answer).
        costs.model_acceptance.limit(self.CARRY_WEIGHT)
        self.alpha = {"prompt-lookup": Acceptance(), "model": costs.model_acceptance}
        self.gate = costs.gate
        self.rounds: dict[str, int] = {}
        self.reset()

    def reset(self) -> None:
        if self.model is not None:
            self.model.reset()
        self._last: tuple[str, int] = ("none", 0)
        self._confs: list[float] = []
        self._plain_streak = 0
        # each request probes the draft early: what the earlier ones measured (carried at CARRY_WEIGHT tokens) may be
        # another kind of text (a chat answer's failures kept a 47-token JSON answer plain to its end)
        self._probe_gap = self.FIRST_PROBE
        self._probe_model_next = True
        self._probe_left = 0
        self._probe_k = self.PROBE_K
        self._probing = False
        self._unverified: tuple[float, int, int] | None = None  # a dropped draw (conf, token, position) to check
        self._shadow: tuple[int, np.ndarray] | None = None  # (position, tokens) a lookup not run would have proposed
        self._round_start = 0
        self.rounds = {}
        self._start: int | None = None  # context length at the request's first round
        self._t_first = 0.0  # clock at the request's first round
        self._gap_from: int | None = None  # context length where lookup's current gap (no match) began
        self._asked = 0  # context length at the last round lookup was asked at (_gap)
        self._gaps = (0, 0)  # tokens and number of this request's gaps between lookup matches, ended so far
        self._copied = 0  # tokens of this request's text its lookup proposals matched (run or not: ``_learn_lookup``)
        self._streak = 0  # model rounds in a row so far
        self._sure = [0, 0]  # this request's committed tokens the target was sure of (TargetSplit.SURE), and all

    def propose(self, tokens, k, params, rng) -> Proposal:  # noqa: ANN001
        if k <= 0:  # the last token of a request: nothing to draft
            self._last = ("none", 0)
            self.rounds["none"] = self.rounds.get("none", 0) + 1
            return EMPTY
        if self._unverified is not None:
            conf, token, at = self._unverified
            self._unverified = None
            if at < len(tokens):
                self.gate.record([conf], accepted=int(tokens[at] == token))
        if self._shadow is not None:  # what the last round's lookup would have proposed, against what was committed
            self._learn_lookup(tokens, *self._shadow)
            self._shadow = None
        look = self.lookup.propose(tokens, k, params, rng)
        # what the draft must feed first
        plan = self.model.catchup_plan(len(tokens), tokens) if self.model is not None else []
        catchup = self.costs.catchup_time(plan)
        if self._start is None:
            self._start, self._t_first = len(tokens), self.clock()  # the prompt and the token its prefill produced
        horizon = min(self.HORIZON_CAP, max(1, params.max_new_tokens - 1 - (len(tokens) - self._start)))
        if self.model is not None and catchup > 0 and self._copying(len(tokens) - self._start):
            catchup = self._streak_priced(catchup, horizon, k, sure=len(tokens) - self._start >= self.COPY_TOKENS)
        if self.model is not None and not self.rounds.get("model") and self._sure[1] >= self.CONF_TOKENS:
            # until the request's own draft rounds speak, its prior is what its target's confidence predicts, not what
            # the earlier requests carried: a JSON answer after chats and summaries carried their 0.71 and ran plain
            # where model:4 ran 1.4-1.8x (docs/benchmarks.md)
            self.alpha["model"].reseed(self.costs.target_split.predict(self._sure[0] / self._sure[1]),
                                       self.CARRY_WEIGHT)
        alpha_model = self.alpha["model"].alpha if self.model is not None else None
        gap, pace = self._gap(tokens, len(look.tokens) > 0, params, rng)
        behind_prompt = sum(plan) > len(tokens) - self._start + 1  # the draft has not seen the whole prompt
        d = decide(self.costs, self.alpha["prompt-lookup"].alpha, len(look.tokens), alpha_model, k, self.mode,
                   model_overhead=catchup, horizon=horizon, gap=gap, pace=pace,
                   margin=PROMPT_MARGIN if behind_prompt else MODEL_MARGIN)
        self._probing = False
        if d.kind == "prompt-lookup":
            self._probe_left = 0
        if self._probe_left > 0 and self.model is not None:  # a draft-model probe runs PROBE_ROUNDS rounds
            self._probe_left -= 1
            if d.kind != "model":  # (once the estimate itself says draft, the rounds are no longer probes)
                hope = self.OPTIMISTIC_ALPHA
                d = self._probe_size(decide(self.costs, hope, 0, hope, k, self.mode, model_overhead=catchup,
                                            horizon=horizon))
                self._probing = d.kind == "model"
        elif d.kind == "none":
            self._plain_streak += 1
            untried = self.model is not None and not self.costs.model_tried
            if self._plain_streak >= (self.FIRST_PROBE if untried else self._probe_gap):
                # Re-probe: would any option pay if its drafts were good? Then try it once, so a stale acceptance
                # estimate can recover; the gap doubles each time, so hopeless probing fades out. Probes alternate
                # between the drafters: under the same optimistic acceptance a free lookup match always looks
                # better than the draft model, so on code (short matches everywhere) auto never learned that the
                # 0.5B draft pays there (a whole request plain and lookup at 31 tok/s, model:3 39.5).
                self._plain_streak, self._probe_gap = 0, min(2 * self._probe_gap, 256)
                hope = self.OPTIMISTIC_ALPHA
                model_turn = self.model is not None and (untried or self._probe_model_next)
                self._probe_model_next = not model_turn
                # a probe that would first catch the draft up on the prompt is that investment too (PROMPT_MARGIN):
                # at MODEL_MARGIN, short chat answers paid a ~150 ms prompt catch-up for a probe near their end and
                # ran slower than plain
                d = decide(self.costs, hope, 0 if model_turn else len(look.tokens),
                           hope if self.model is not None else None, k, self.mode, model_overhead=catchup,
                           horizon=horizon, margin=PROMPT_MARGIN if behind_prompt else MODEL_MARGIN)
                if d.kind == "model":  # one round is weak evidence (code's first draft round: 1 of 5 accepted)
                    self._probe_left, self._probe_k = self.PROBE_ROUNDS - 1, self.PROBE_K
                    d = self._probe_size(d)
                    self._probing = True
        else:
            self._plain_streak, self._probe_gap = 0, self.probe_every
        self.rounds[d.kind] = self.rounds.get(d.kind, 0) + 1
        if d.kind != "prompt-lookup" and len(look.tokens):
            self._shadow = (len(tokens), look.tokens)
        if d.kind == "model":
            self._streak += 1
        elif self._streak:
            self.costs.model_streak = 0.7 * self.costs.model_streak + 0.3 * self._streak
            self._streak = 0
        if d.kind == "prompt-lookup":
            look = Proposal(look.tokens[: d.k] if d.k else look.tokens, None)
            self._last = ("prompt-lookup", len(look.tokens))
            return look
        if d.kind == "model":
            assert self.model is not None
            threshold = self.costs.break_even_acceptance(k)
            self._round_start = len(tokens)  # draft i goes to position len(tokens) + i
            t0 = self.model.time_catch_up
            # a probe drafts its whole (short) length: it is there to measure, and the confidence gate, shared with
            # the earlier requests, would cut it to one token where their drafts failed
            keep = None if self._probing else (lambda conf: self.gate.acceptance(conf) >= threshold)
            prop = self.model.propose(tokens, d.k, params, rng, keep=keep, keep_last=self._worth_verifying)
            self.costs.observe_catchup(plan, self.model.time_catch_up - t0)
            self.costs.model_tried = True
            self._confs = self.model.confidences
            if self.model.step_time is not None:
                self.costs.observe_draft(self.model.step_time)
            self._last = ("model", len(prop.tokens))
            return prop
        self._last = ("none", 0)
        return EMPTY

    def _streak_priced(self, catchup: float, horizon: int, k: int, sure: bool = True) -> float:
        """The catch-up as ``decide`` spreads it over ``horizon`` tokens, re-priced by what it buys: it serves the
        run of model rounds it starts, and then auto turns to another kind and the draft falls behind again. So it
        is spread over a run as long as they have lasted (``CostModel.model_streak`` rounds, running across
        requests; prior 32: the whole request), not over the request. Spread over the request, a model round after
        a few lookup rounds looks cheap on edit and summarize prompts and is not.

        Only where the request copies (its lookup's proposals matched at least ``COPYING`` of the tokens it has
        committed, ``_copying``): runs are short because lookup rounds cut them, and runs learned on edits would
        price a JSON or code request's prompt catch-up (and its probes) out for the whole request, where lookup
        rarely matches and a model run lasts the request.

        Not ``sure`` (the request's first ``COPY_TOKENS``, taken to copy before it has shown whether it does): a run
        is taken to last at least ``UNSURE_SHARE`` of the horizon, so that very short runs learned on a summary do
        not keep the JSON answers after it plain for their first tokens (measured: json-0 0.69 -> 0.95x model:4,
        docs/benchmarks.md). Where the target's confidence already says more, more (``_unsure_share``)."""
        run = max(1.0, self.costs.model_streak * expected_tokens_per_round(self.alpha["model"].alpha, min(k, 4)))
        if not sure:
            run = max(run, self._unsure_share() * horizon)
        return catchup * max(1.0, horizon / run)

    def _unsure_share(self) -> float:
        """The share of the request a run of model rounds is taken to last while the request has not shown whether
        it copies: ``UNSURE_SHARE``, or, where its lookup has matched nothing yet and the target's confidence is
        known (``CONF_TOKENS``), the share of its tokens the target was sure of, if more. The draft's run lasts
        until lookup cuts in or the draft fails, and where the target is sure it seldom fails: a JSON answer
        (every token sure, nothing copied) after a chat answer whose runs lookup had cut short would otherwise price
        its long prompt's catch-up over a fifth of the request and run plain for most of it. The cost: an edit whose
        first tokens the target is half sure of may start model runs that lookup then cuts short
        (``docs/benchmarks.md``)."""
        if self._copied or self._sure[1] < self.CONF_TOKENS:
            return self.UNSURE_SHARE
        return max(self.UNSURE_SHARE, self._sure[0] / self._sure[1])

    def _gap(self, tokens: np.ndarray, matched: bool, params, rng) -> tuple[float, float]:  # noqa: ANN001
        """(expected tokens until lookup matches again, the request's tokens/s) for ``decide``, where this round is
        in a gap of a copying request (lookup has no match; its proposals matched ``COPYING`` of the text, past
        ``COPY_TOKENS``) whose earlier gaps say how long one lasts (their mean: ~2 tokens through summarize-2, 4-11
        through the edits, 13-16 through code); else (inf, 0): the fastest option, as without it. A summary
        realigns with its source within a token or two, so a draft-model round in its gap commits what lookup would
        have committed at ~150 tok/s: scored by tokens per second alone, such rounds (predicted faster than plain,
        slower with their catch-up) ran summarize-2 at 0.76-0.85x fixed lookup. A longer gap (an edit
        writing new lines) keeps the model rounds that pay there. A gap ends where lookup would have matched again,
        which may be inside the round that ended it: measured to the round's end, a model round's 3-4 tokens made
        summarize-2's gaps look 4.5 tokens long, and its rounds kept their place there."""
        n_tokens = len(tokens)
        if matched and self._gap_from is not None:  # a gap ends: where, within the last round? (earlier rounds'
            # starts were asked at the time: no match)
            end = next((p for p in range(max(self._gap_from, self._asked) + 1, n_tokens)
                        if len(self.lookup.propose(tokens[:p], 1, params, rng).tokens)), n_tokens)
            self._gaps = (self._gaps[0] + end - self._gap_from, self._gaps[1] + 1)
            self._gap_from = None
        elif not matched and self._gap_from is None:
            self._gap_from = n_tokens
        self._asked = n_tokens
        committed, seconds = n_tokens - (self._start or 0), self.clock() - self._t_first
        if matched or not self._gaps[1] or seconds <= 0 or committed < self.COPY_TOKENS \
                or not self._copying(committed):
            return float("inf"), 0.0
        return self._gaps[0] / self._gaps[1], committed / seconds  # (gaps taken as memoryless: their mean)

    def _copying(self, committed: int) -> bool:
        """Whether this request copies its context: the lookup's proposals (in its own rounds and, asked for free,
        in the others) matched at least ``COPYING`` of the tokens committed so far. (Lookup rounds were 0.38-0.72 of
        the rounds of the Qwen pair's edit and summarize prompts, 0-0.27 of code, JSON and chat ones.) Until
        ``COPY_TOKENS`` are committed it is taken to copy: the learned runs price the draft."""
        return committed < self.COPY_TOKENS or self._copied >= self.COPYING * committed

    def _learn_lookup(self, tokens: np.ndarray, start: int, proposed: np.ndarray) -> None:
        """The lookup's acceptance from a round it did not run: asking it costs nothing, and once the round has
        committed, the tokens at its positions say how much of its proposal the target would have taken (greedy:
        exactly; sampled: equality stands in for the acceptance test, as for the gate's dropped draw). Learned only
        from its own rounds, a lookup at its 50 % prior behind a good draft model was never chosen, so never
        corrected. Tokens past what the round committed are unknown: a proposal that agrees that far counts no
        failure."""
        seen = tokens[start: start + len(proposed)]
        if len(seen) == 0:
            return
        diff = np.flatnonzero(proposed[: len(seen)] != seen)
        agree = int(diff[0]) if len(diff) else len(seen)
        self.alpha["prompt-lookup"].update(min(len(seen), agree + 1), agree)
        self._copied += agree

    def _worth_verifying(self, conf: float, n: int) -> bool:
        """The draw that stopped a round, its draft step already paid: proposed as the round's n-th token when its
        expected worth (its confidence bin's acceptance times a plain step, the time a token costs without it) beats
        the extra row it adds to the verify step. On 2 EPYC cores a row of a 2-5 token step costs 1-3 ms against a
        33 ms plain step, so a draw that passes a tenth of the time pays; dropping it threw away a draft step
        (~11 ms for the Qwen 0.5B draft) a round."""
        extra = self.costs.verify_time(n + 1) - self.costs.verify_time(n)
        return self.gate.acceptance(conf) * self.costs.verify_time(1) > extra

    def _probe_size(self, d: Decision) -> Decision:
        """A probe is chosen at the draft length that would pay if the draft were good, and run shorter: it is there
        to measure the acceptance, which a 2-token round measures as well, at half the cost where it fails. Each
        probe round whose drafts all pass doubles the next one's length (a 2-token round also pays an extra draft
        step for the bonus token the draft has not seen: half again the drafting of a 4-token round)."""
        return Decision(d.kind, min(d.k, self._probe_k), d.rate) if d.kind == "model" else d

    def wants_confidence(self) -> bool:
        """Whether the decoder should pass the round just committed's target confidences (``observe_confidence``):
        only with a draft model, and only in the request's first ``CONF_WINDOW`` tokens. Its prior needs them only
        before its first draft-model round, and ``TargetSplit`` learns well enough from every request's first
        ones."""
        return self.model is not None and self._sure[1] < self.CONF_WINDOW

    def observe_confidence(self, confs: list[float]) -> None:
        """The target's top-1 probability at each row of the round just committed (rows 0..m: the m accepted drafts'
        and the target's own token): a draft-model round's rows teach ``CostModel.target_split`` what the draft
        passes where the target is sure, and every round's rows add to the request's share of sure tokens."""
        kind, n = self._last
        if kind == "model" and n:
            self.costs.target_split.record(confs[:n], min(len(confs) - 1, n))
        self._sure[0] += sum(c > TargetSplit.SURE for c in confs)
        self._sure[1] += len(confs)

    def commit(self, n_accepted: int) -> None:
        kind, n = self._last
        if kind == "none":
            return
        if kind == "model" and getattr(self.model, "last_was_stopper", False):
            # the draw the gate stopped at rode along for free: the acceptance the next rounds are priced by is that
            # of the tokens the gate lets through (with the stopper's misses in it, auto drafted less where the draft
            # is good); its confidence bin learns from it below all the same
            self.alpha[kind].update(n - 1, min(n_accepted, n - 1))
        else:
            self.alpha[kind].update(n, n_accepted)
        if kind == "prompt-lookup":
            self._copied += n_accepted
        if kind == "model" and self._probing and 0 < n == n_accepted:
            # a probe whose drafts all pass goes on, longer: three 2-token rounds cannot outweigh the acceptance an
            # earlier request carried over (a JSON answer after a chat one went back to plain with the draft at 6/6)
            self._probe_left = max(self._probe_left, 1)
            self._probe_k = min(2 * self._probe_k, 16)
        if kind == "model":
            assert self.model is not None
            self.gate.record(self._confs, n_accepted)
            # The draw the gate dropped is checked for free when the round passes whole: the target's next token
            # (the round's bonus token, at the dropped draw's position) is what it would have been verified
            # against (under sampling, equality stands in for the acceptance test). Without this, a confidence
            # bin whose prior sits below break-even never learns, as its draws are never verified: on chat the
            # Qwen 0.5B draft's tokens at 40-70 % confidence passed 67-100 % of the time (model:4), the prior
            # said 45-65 %, and auto's rounds mostly drafted one token.
            dropped = self.model.dropped
            if dropped is not None and n_accepted == n:
                self._unverified = (dropped[1], dropped[0], self._round_start + n)
            self.model.commit(n_accepted)

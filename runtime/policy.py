"""auto's decision, as pure functions of measured numbers: step costs (:class:`CostModel`), acceptance estimates
(:class:`Acceptance`, :class:`TargetSplit`, :class:`ConfidenceGate`) and :func:`decide`, which picks a round's
drafter and draft length by predicted tokens per second. :class:`adaptive.AutoDrafter` runs it every round;
``tools/dev/lookup_replay.py`` replays it over recorded traces. The formulas are in adaptive.py's docstring.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from .trees import BranchOdds

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
    branch_odds: BranchOdds = field(default_factory=lambda: BranchOdds())  # tree branches' hits (:mod:`.trees`)
    plain_pace: float | None = None  # tokens per second plain rounds have run at, whole rounds on the wall clock
    # The context the step costs were timed at (``target``, ``draft``), and what each further position adds to a step:
    # seconds per position at speed 1 for some target widths (``target_slope``; others interpolated linearly in the
    # width, the attention's rows) and for the draft's one-token step. ``depth``: the context the next steps attend
    # over (the decoder sets it each round), so a 3,000-token prompt's rounds are priced at its own depth.
    base_depth: int = 0
    target_slope: dict[int, float] = field(default_factory=dict)
    draft_slope: float = 0.0
    depth: int = 0

    def _slope(self, w: int) -> float:
        """Seconds per position of context a target step of width w adds (at speed 1)."""
        s = self.target_slope
        if not s:
            return 0.0
        if w in s:
            return s[w]
        ws = sorted(s)
        if len(ws) == 1:
            return s[ws[0]] * w / ws[0]
        i = min(max(bisect.bisect_left(ws, w), 1), len(ws) - 1)  # the timed widths around w (the end two outside)
        lo, hi = ws[i - 1], ws[i]
        return max(0.0, s[lo] + (s[hi] - s[lo]) * (w - lo) / (hi - lo))

    def _width_time(self, w: int, depth: int | None) -> float:
        """Seconds of a target step of width w at ``depth`` positions (None: ``self.depth``), at speed 1; never
        below half the width's timed cost (a context shorter than the timing's)."""
        d = self.depth if depth is None else depth
        return max(0.5 * self.target[w], self.target[w] + self._slope(w) * (d - self.base_depth))

    def verify_time(self, n: int, depth: int | None = None) -> float:
        """Time of the target step that n tokens run in (the smallest width >= n), at ``depth`` positions of
        context (None: ``self.depth``; a batched step of several requests: their mean)."""
        fits = [t for t in self.target if t >= n]
        return self.speed * self._width_time(min(fits), depth) if fits else float("inf")

    def observe_target(self, n: int, seconds: float, depth: int | None = None) -> None:
        """A target step of n tokens at ``depth`` positions took ``seconds``: the speed takes (1 - decay) of its
        log-ratio to the prediction, the width's shape (1 - shape_decay) of what is left."""
        fits = [t for t in self.target if t >= n]
        if fits and seconds > 0:
            w = min(fits)
            self.speed *= (seconds / (self.speed * self._width_time(w, depth))) ** (1 - self.decay)
            self.target[w] *= (seconds / (self.speed * self._width_time(w, depth))) ** (1 - self.shape_decay)

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

    def _draft_depth(self) -> float:
        """What ``depth`` adds to a one-token draft step, at speed 1."""
        return self.draft_slope * (self.depth - self.base_depth)

    def observe_draft(self, seconds_per_step: float) -> None:
        shape = max(0.5 * (self.draft or 0.0), seconds_per_step / self.speed - self._draft_depth())
        self.draft = shape if self.draft is None else self.decay * self.draft + (1 - self.decay) * shape

    def draft_time(self) -> float:
        """Seconds of one 1-token draft step now (0 without a draft), at ``depth`` positions."""
        if not self.draft:
            return 0.0
        return self.speed * max(0.5 * self.draft, self.draft + self._draft_depth())

    # -- predicted tokens per second ------------------------------------------------
    def observe_guess(self, confirmed: int) -> None:
        """A plain round's free guess was confirmed (1) or not (0): plain decoding yields 1 + that per step."""
        self.guess_alpha = self.decay * self.guess_alpha + (1 - self.decay) * float(confirmed)

    def rate_plain(self) -> float:
        return (1.0 + self.guess_alpha) / self.verify_time(1)

    def observe_plain_round(self, seconds: float, tokens: int) -> None:
        """A plain round took ``seconds`` on the wall clock (its step and the host's work) and committed ``tokens``:
        ``plain_pace`` moves (1 - decay) of the way to that round's tokens per second."""
        if seconds > 0 and tokens > 0:
            r = tokens / seconds
            self.plain_pace = r if self.plain_pace is None else self.decay * self.plain_pace + (1 - self.decay) * r

    def measured_plain_rate(self) -> float:
        """Tokens per second of a plain round as measured whole (``plain_pace``), else as its step predicts."""
        return self.plain_pace if self.plain_pace is not None else self.rate_plain()

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

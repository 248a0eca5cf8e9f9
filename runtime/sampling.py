"""Sampling and speculative verification as pure functions over numpy arrays.

Naming: ``p_target`` is the target model's processed distribution, ``q_draft``
the draft's (the paper's notation; gpt-fast swaps the letters).

Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023). For draft
tokens d_1..d_n drawn from q_i and target distributions p_1..p_{n+1}:

    accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), left to right;
    at the first rejection emit x ~ norm(max(0, p_i - q_i)) and stop;
    if all n are accepted emit the bonus x ~ p_{n+1}.

Every emitted token is then distributed exactly as p. Temperature, top-k and
top-p are applied to both p and q before the test, identically
(:func:`process_logits`). Temperature 0 is greedy: accept while d_i == argmax p_i.
A deterministic proposal (prompt lookup) is q = one-hot(d_i).

Position-keyed sampling (``sampler="keyed"``, the default). The token at sequence
position i is a pure function of (p_i, seed, i):

    x_i = argmax_x p_i(x) / E_{seed,i}(x),   E_{seed,i}(x) ~ Exp(1) i.i.d., drawn from a
                                             generator seeded with (seed, i)

(the exponential race, i.e. Gumbel-max: P(x_i = x) = p_i(x) exactly). Speculation then
only guesses x_i: accept d_i iff d_i == x_i, emit x_i at the first mismatch, else the
bonus x_{n+1}. Plain decoding, every drafter, every k and every adaptive choice emit the
same text for the same seed, because the target's rows are batch-invariant (see
GraphRunner.min_width). A model draft samples with the same keyed noise, so it agrees
with the target whenever q is close to p.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import SamplingParamsError

SAMPLERS = ("keyed", "classic")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    sampler: str = "keyed"  # keyed: a seed fixes the text whatever the drafter | classic: min(1, p/q)

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "top_k", "seed", "temperature", "top_p"):  # numpy's scalars as Python's
            v = getattr(self, name)
            if isinstance(v, (np.integer, np.floating)):
                object.__setattr__(self, name, v.item())
        if self.stop is None:
            object.__setattr__(self, "stop", ())
        if isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop, (str, tuple)):
            raise SamplingParamsError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool):
            raise SamplingParamsError(f"top_p must be a number in (0, 1] (1 = off), got {self.top_p!r}")
        if isinstance(self.max_new_tokens, bool) or isinstance(self.top_k, bool):
            raise SamplingParamsError("max_new_tokens and top_k must be integers, not booleans")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SamplingParamsError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not np.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError(f"temperature must be a finite number >= 0 (0 = greedy), got "
                                      f"{self.temperature!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2 ** 63):
            raise SamplingParamsError(f"seed must be an int in 0..2**63-1 (or None), got {self.seed!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingParamsError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.sampler not in SAMPLERS:
            raise SamplingParamsError(f"sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError(f"stop strings must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Logits [N, V] -> probabilities [N, V] (float64) after temperature, top-k, top-p.

    top-k keeps every token whose logit is >= the k-th largest (ties kept);
    top-p keeps the smallest prefix of the sorted distribution whose mass reaches
    top_p (the most likely token is always kept). temperature must be > 0.
    """
    raw = np.asarray(logits, dtype=np.float64)  # [N, V]
    with np.errstate(over="ignore"):  # max first: z <= 0, so a tiny temperature gives -inf, never NaN
        z = (raw - raw.max(axis=-1, keepdims=True)) / temperature
    V = z.shape[-1]
    if 0 < top_k < V:  # on the raw logits: the shift and scale above may round distinct values together
        kth = np.partition(raw, V - top_k, axis=-1)[:, V - top_k: V - top_k + 1]  # [N, 1]
        z = np.where(raw >= kth, z, -np.inf)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")  # [N, V]
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        cum = np.cumsum(sorted_p, axis=-1)
        keep_sorted = (cum - sorted_p) < top_p  # mass before this token is still short of top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a probability vector [V] by inverting its CDF."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))


def residual(p_target: np.ndarray, q_draft: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)) for one position [V]. Falls back to p if p <= q everywhere (p == q)."""
    r = np.maximum(p_target - q_draft, 0.0)
    s = r.sum()
    return r / s if s > 0 else p_target


def verify_greedy(target_logits: np.ndarray, draft_tokens: np.ndarray) -> tuple[int, int]:
    """Greedy acceptance. target_logits [n+1, V], draft_tokens [n] -> (n_accepted, next_token).

    Accept d_i while d_i == argmax p_i; the next token is argmax at the first mismatch (or the bonus row).
    """
    return accept_argmax(np.argmax(target_logits, axis=-1), draft_tokens)


def accept_argmax(best: np.ndarray, draft_tokens: np.ndarray) -> tuple[int, int]:
    """Greedy acceptance from the target's argmax ids [n+1] (computed here or on the device)."""
    n = len(draft_tokens)
    m = 0
    while m < n and best[m] == draft_tokens[m]:
        m += 1
    return m, int(best[m])


def verify_sampled(p_target: np.ndarray, q_draft: np.ndarray | None, draft_tokens: np.ndarray,
                   rng: np.random.Generator) -> tuple[int, int]:
    """Exact rejection sampling. p_target [n+1, V], q_draft [n, V] or None for one-hot proposals,
    draft_tokens [n] -> (n_accepted, next_token). See the module docstring for the rule."""
    n = len(draft_tokens)
    for i in range(n):
        d = int(draft_tokens[i])
        q_d = 1.0 if q_draft is None else q_draft[i, d]
        if rng.random() * q_d < p_target[i, d]:  # u < p/q without dividing (q_d > 0: d was drawn from q)
            continue
        if q_draft is None:
            q_row = np.zeros_like(p_target[i])
            q_row[d] = 1.0
        else:
            q_row = q_draft[i]
        return i, sample(residual(p_target[i], q_row), rng)
    return n, sample(p_target[n], rng)


def keyed_exponentials(seed: int, position: int, V: int) -> np.ndarray:
    """E [V] ~ Exp(1) i.i.d., a pure function of (seed, position) (numpy's SeedSequence hashes the pair)."""
    return np.random.default_rng([seed, position]).standard_exponential(V)


def keyed_sample(probs: np.ndarray, seed: int, position: int, noise: np.ndarray | None = None) -> int:
    """One exact draw from probs [V] that depends only on (probs, seed, position): argmax probs / E. ``noise``: E
    already drawn (``keyed_exponentials(seed, position, V)``), to be shared with other uses at this position."""
    e = keyed_exponentials(seed, position, probs.shape[-1]) if noise is None else noise
    return int(np.argmax(probs / e))


def verify_keyed(p_target: np.ndarray, draft_tokens: np.ndarray, seed: int, position: int) -> tuple[int, int]:
    """Position-keyed acceptance. p_target [n+1, V] for positions position..position+n, draft_tokens [n]
    -> (n_accepted, next_token): accept d_i iff it is the keyed token x_i; emit x at the first mismatch."""
    n = len(draft_tokens)
    for i in range(n + 1):
        x = keyed_sample(p_target[i], seed, position + i)
        if i == n or x != draft_tokens[i]:
            return i, x
    raise AssertionError("unreachable")


def verify_round(logits: np.ndarray, draft_tokens: np.ndarray, q_draft: np.ndarray | None, params: SamplingParams,
                 rng: np.random.Generator, position: int) -> tuple[int, int]:
    """A verify step's rows logits [n+1, V] (row i at sequence ``position`` + i) against the draft: (accepted,
    next token) by the rule ``params`` asks for: greedy, keyed, or classic rejection sampling."""
    if params.greedy:
        return verify_greedy(logits, draft_tokens)
    p_target = process_logits(logits, params.temperature, params.top_k, params.top_p)
    if params.sampler == "keyed":
        return verify_keyed(p_target, draft_tokens, params.seed, position)
    return verify_sampled(p_target, q_draft, draft_tokens, rng)


def top1_probability(logits: np.ndarray) -> list[float]:
    """The softmax's largest probability in each row of logits [n, V] (the model's own, at temperature 1): how
    sure it is of its next token."""
    rows = np.asarray(logits, dtype=np.float32)
    z = rows - rows.max(axis=-1, keepdims=True)  # one temporary [n, V], exponentiated in place
    return (1.0 / np.exp(z, out=z).sum(axis=-1)).tolist()


def choose_next(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
                position: int | None = None) -> int:
    """Plain sampling of one token from logits [V] (greedy at temperature 0) for sequence ``position``
    (needed by the keyed sampler, whose params.seed the decoder has resolved)."""
    if params.greedy:
        return int(np.argmax(logits))
    probs = process_logits(logits[None], params.temperature, params.top_k, params.top_p)[0]
    if params.sampler == "keyed":
        assert params.seed is not None and position is not None
        return keyed_sample(probs, params.seed, position)
    return sample(probs, rng)

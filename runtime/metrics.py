"""Prometheus text-format metrics for `spec-run serve` (no client library: a few counters and histograms)."""

from __future__ import annotations

import threading
from typing import Any

_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Counter:
    def __init__(self) -> None:
        self.value = 0.0
        self._lock = threading.Lock()

    def inc(self, by: float = 1.0) -> None:
        with self._lock:
            self.value += by


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets, self.counts = buckets, [0] * (len(buckets) + 1)
        self.sum, self.n = 0.0, 0
        self._lock = threading.Lock()

    def observe(self, v: float) -> None:
        with self._lock:
            i = next((j for j, b in enumerate(self.buckets) if v <= b), len(self.buckets))
            self.counts[i] += 1
            self.sum += v
            self.n += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.n}"]
        return out


# Where an admitted request is: each one is in exactly one of these at any moment, so at every scrape
# requests_total = completed + cancelled + rejected + failed + queued + running.
STATES = ("queued", "running", "completed", "cancelled", "rejected", "failed")


class Metrics:
    """The server's counters. A request's state moves under one lock (``admit``, ``move``) and ``render`` reads
    them under it, so the states add up to ``requests`` in every scrape. Tokens count the work done: a cancelled or
    failed request's prompt and generated tokens too (``observe_partial``); drafts, reuse, rounds and latencies
    count completed requests (``observe``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.state = dict.fromkeys(STATES, 0)
        self.prompt_tokens, self.completion_tokens, self.reused_tokens = Counter(), Counter(), Counter()
        self.drafted, self.accepted = Counter(), Counter()
        self.ttft, self.tpot = Histogram(_TTFT_BUCKETS), Histogram(_TPOT_BUCKETS)
        self.rounds: dict[str, Counter] = {}
        self.batch: Any = None  # the decoder's Batch (max_batch > 1): rounds per number of requests decoding

    def admit(self, state: str = "queued") -> None:
        """A new request, ``queued`` (or ``rejected`` at once: the server was busy)."""
        with self._lock:
            self.requests += 1
            self.state[state] += 1

    def move(self, src: str, dst: str) -> None:
        with self._lock:
            assert self.state[src] > 0, (src, dst, self.state)
            self.state[src] -= 1
            self.state[dst] += 1

    def snapshot(self) -> dict[str, int]:
        """``requests`` and the count in each state, read together."""
        with self._lock:
            return {"requests": self.requests, **self.state}

    def observe(self, stats: Any) -> None:
        """A completed request's statistics."""
        self.observe_partial(stats.prompt_tokens, stats.new_tokens)
        self.reused_tokens.inc(stats.reused_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.ttft.observe(stats.ttft_s)
        if stats.new_tokens > 1:
            self.tpot.observe(stats.decode_s / (stats.new_tokens - 1))
        with self._lock:
            for name, n in (stats.strategies or {}).items():
                self.rounds.setdefault(name, Counter()).inc(n)

    def observe_partial(self, prompt_tokens: int, new_tokens: int) -> None:
        """The tokens a request processed, whether or not it completed."""
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(new_tokens)

    def render(self) -> str:
        p = "specedge_"
        snap = self.snapshot()

        def counter(name: str, v: float) -> list[str]:
            return [f"# TYPE {p}{name} counter", f"{p}{name} {v:.0f}"]

        lines = [*counter("requests_total", snap["requests"]),
                 *[line for s in ("completed", "cancelled", "rejected", "failed")
                   for line in counter(f"requests_{s}_total", snap[s])],
                 f"# TYPE {p}queue_depth gauge", f"{p}queue_depth {snap['queued']}",
                 f"# TYPE {p}requests_running gauge", f"{p}requests_running {snap['running']}",
                 *counter("prompt_tokens_total", self.prompt_tokens.value),
                 *counter("completion_tokens_total", self.completion_tokens.value),
                 *counter("reused_prompt_tokens_total", self.reused_tokens.value),
                 *counter("draft_tokens_total", self.drafted.value),
                 *counter("accepted_tokens_total", self.accepted.value),
                 f"# TYPE {p}rounds_total counter"]
        with self._lock:
            lines += [f'{p}rounds_total{{strategy="{k}"}} {v.value:.0f}' for k, v in sorted(self.rounds.items())]
        if self.batch is not None:  # read without the decoder's lock: a dict copied whole
            sizes = dict(self.batch.sizes)
            lines += [f"# TYPE {p}batch_rounds_total counter",
                      *[f'{p}batch_rounds_total{{requests="{n}"}} {v}' for n, v in sorted(sizes.items())]]
        lines += [f"# TYPE {p}time_to_first_token_seconds histogram",
                  *self.ttft.lines(f"{p}time_to_first_token_seconds"),
                  f"# TYPE {p}time_per_output_token_seconds histogram",
                  *self.tpot.lines(f"{p}time_per_output_token_seconds")]
        return "\n".join(lines) + "\n"

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


class Gauge(Counter):
    def set(self, v: float) -> None:
        with self._lock:
            self.value = float(v)


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


class Metrics:
    def __init__(self) -> None:
        self.requests, self.rejected, self.cancelled = Counter(), Counter(), Counter()
        self.prompt_tokens, self.completion_tokens, self.reused_tokens = Counter(), Counter(), Counter()
        self.drafted, self.accepted = Counter(), Counter()
        self.queue_depth = Gauge()
        self.ttft, self.tpot = Histogram(_TTFT_BUCKETS), Histogram(_TPOT_BUCKETS)
        self.rounds: dict[str, Counter] = {}
        self._lock = threading.Lock()

    def observe(self, stats: Any, latency_s: float) -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.completion_tokens.inc(stats.new_tokens)
        self.reused_tokens.inc(stats.reused_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.ttft.observe(stats.ttft_s)
        if stats.new_tokens > 1:
            self.tpot.observe(stats.decode_s / (stats.new_tokens - 1))
        with self._lock:
            for name, n in (stats.strategies or {}).items():
                self.rounds.setdefault(name, Counter()).inc(n)

    def render(self) -> str:
        p = "specedge_"
        lines = [
            f"# TYPE {p}requests_total counter", f"{p}requests_total {self.requests.value:.0f}",
            f"# TYPE {p}requests_rejected_total counter", f"{p}requests_rejected_total {self.rejected.value:.0f}",
            f"# TYPE {p}requests_cancelled_total counter", f"{p}requests_cancelled_total {self.cancelled.value:.0f}",
            f"# TYPE {p}prompt_tokens_total counter", f"{p}prompt_tokens_total {self.prompt_tokens.value:.0f}",
            f"# TYPE {p}completion_tokens_total counter",
            f"{p}completion_tokens_total {self.completion_tokens.value:.0f}",
            f"# TYPE {p}reused_prompt_tokens_total counter",
            f"{p}reused_prompt_tokens_total {self.reused_tokens.value:.0f}",
            f"# TYPE {p}draft_tokens_total counter", f"{p}draft_tokens_total {self.drafted.value:.0f}",
            f"# TYPE {p}accepted_tokens_total counter", f"{p}accepted_tokens_total {self.accepted.value:.0f}",
            f"# TYPE {p}queue_depth gauge", f"{p}queue_depth {self.queue_depth.value:.0f}",
            f"# TYPE {p}rounds_total counter",
        ]
        with self._lock:
            lines += [f'{p}rounds_total{{strategy="{k}"}} {v.value:.0f}' for k, v in sorted(self.rounds.items())]
        lines += [f"# TYPE {p}time_to_first_token_seconds histogram",
                  *self.ttft.lines(f"{p}time_to_first_token_seconds"),
                  f"# TYPE {p}time_per_output_token_seconds histogram",
                  *self.tpot.lines(f"{p}time_per_output_token_seconds")]
        return "\n".join(lines) + "\n"

"""Per-request statistics of the decode loop."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    drafter: str = "none"
    k: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0  # prompt in -> first token out (prefill + first sample)
    decode_s: float = 0.0  # first token -> last token
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accept_hist: list[int] = field(default_factory=list)  # [m] = rounds that accepted m draft tokens
    guesses: int = 0  # rounds with no draft whose width-2 step checked a free one-token guess
    reused_tokens: int = 0  # prompt tokens whose cache rows a previous request left (not prefilled again)
    resyncs: int = 0  # times this stream re-prefilled because another request used the decoder meanwhile
    guesses_accepted: int = 0  # of those, the guesses the target confirmed (a free token each)
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    time_host_s: float = 0.0  # sampling, acceptance, bookkeeping, detokenization
    finish_reason: str = ""
    strategies: dict[str, int] = field(default_factory=dict)  # rounds per strategy (auto/hybrid pick per round)
    tree_shapes: dict[str, int] = field(default_factory=dict)  # tree rounds per shape, "spine+branches" (trees.shape)
    branched: int = 0  # tree rounds whose accepted path left the spine (a branch was the target's token)

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first, per second of decode time."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 and self.new_tokens > 1 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_per_round(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tree_rounds(self) -> int:
        return sum(self.tree_shapes.values())

    def record_round(self, drafted: int, accepted: int, guessed: int | None = None, tree: str | None = None,
                     branched: bool = False) -> None:
        """guessed: for a round without a draft, whether (1) or not (0) its free guess was confirmed. tree: a tree
        round's shape (drafted counts its spine; accepted its path, which may leave the spine: ``branched``)."""
        if tree is not None:
            self.tree_shapes[tree] = self.tree_shapes.get(tree, 0) + 1
            self.branched += bool(branched)
        if guessed is not None:
            self.guesses += 1
            self.guesses_accepted += guessed
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        while len(self.accept_hist) <= accepted:
            self.accept_hist.append(0)
        self.accept_hist[accepted] += 1

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(decode_tok_s=self.decode_tok_s, acceptance_rate=self.acceptance_rate,
                 mean_accepted_per_round=self.mean_accepted_per_round, tree_rounds=self.tree_rounds)
        return d

    def __str__(self) -> str:
        return (
            f"drafter={self.drafter} K={self.k} prompt={self.prompt_tokens} new={self.new_tokens} "
            f"ttft={self.ttft_s * 1000:.0f}ms decode={self.decode_tok_s:.1f} tok/s rounds={self.rounds} "
            f"drafted={self.drafted} accepted={self.accepted} ({self.acceptance_rate:.0%}, "
            f"{self.mean_accepted_per_round:.2f}/round) hist={self.accept_hist} "
            + (f"free guesses={self.guesses_accepted}/{self.guesses} " if self.guesses else "")
            + (f"trees={self.tree_rounds} (branch taken {self.branched}) shapes={self.tree_shapes} "
               if self.tree_shapes else "") +
            f"time draft={self.time_draft_s:.3f}s verify={self.time_verify_s:.3f}s host={self.time_host_s:.3f}s "
            f"finish={self.finish_reason}" + (f" strategies={self.strategies}" if self.strategies else "")
        )

"""What a KV cache's leading rows hold, kept true whatever is interrupted.

A cache's rows 0..count-1 are those of ``of[:count]``: a prefix of one request's committed tokens (committed
tokens are never rewritten, so holding the request's array is enough). A later request with the same leading
tokens reuses those rows instead of computing them again. The record is narrowed *before* anything writes a row
and widened only *after* the write returned, so an exception at any point (a KeyboardInterrupt in a notebook, a
timeout, a failing step) leaves it claiming only rows that were written for its tokens: an interrupted prefill can
never hand its half-written rows to the next request.
"""

from __future__ import annotations

import numpy as np


def common_prefix(held: np.ndarray | None, ids: np.ndarray) -> int:
    """How many leading tokens of ``ids`` the rows for ``held`` serve, keeping at least the last token of ``ids`` to
    feed (its step gives the next token's logits): where a prefill of ``ids`` over those rows starts."""
    if held is None:
        return 0
    m = min(len(held), len(ids) - 1)
    diff = np.flatnonzero(held[:m] != ids[:m])
    return int(diff[0]) if len(diff) else m


class CacheRows:
    def __init__(self) -> None:
        self.of: np.ndarray | None = None  # the tokens the rows are for (an array the request owns)
        self.count = 0  # rows 0..count-1 hold of[:count]

    def agree(self, ids: np.ndarray) -> int:
        """How many leading tokens of ``ids`` already have their rows here, keeping at least the last token to
        feed: where a prefill of ``ids`` can start."""
        return common_prefix(None if self.of is None else self.of[: self.count], ids)

    def holds(self, tokens: np.ndarray, count: int) -> bool:
        """Whether the rows are those of ``tokens[:count]`` (an array of committed tokens, by identity)."""
        return self.of is tokens and self.count >= count

    def writing(self, tokens: np.ndarray, start: int) -> None:
        """Before writing rows for ``tokens`` from ``start`` on: only rows before ``start`` that agree with them
        stay counted (call with ``start <= agree(tokens)``)."""
        self.of, self.count = tokens, min(start, self.count if self.of is not None else 0)

    def wrote(self, tokens: np.ndarray, count: int) -> None:
        """After the rows of ``tokens[:count]`` were written."""
        self.of, self.count = tokens, count

    def forget(self) -> None:
        """Rows were written that no request's tokens describe (a timing's dummy steps)."""
        self.of, self.count = None, 0

"""Tree verification: several continuations checked in one target step.

A tree proposal is a :class:`~.drafters.Proposal` with ``parents``: node i is token ``tokens[i]`` following node
``parents[i]`` (-1: the last committed token, the root), parents before children. Its leading nodes 0..s-1 with
parents -1, 0, .., s-2 are the *spine* (the drafter's chain); the rest branch off it. The verify step runs the root
and every node as tree rows of a row-addressed bundle (``step_tree``): node i is written at cache row n + i and
attends to the committed rows and its ancestors' only, at position n + its depth - 1, so its logits are bitwise those
of its path decoded as a chain (runtime/csrc/sek_attn.c).

The round then walks down from the root: at each row the target's own token (argmax; or the keyed draw for its
position, which depends on that row's logits, the seed and the position alone) is looked for among the row's
children; the walk goes on through the child that equals it and stops where none does, emitting the target's
token there. So a tree commits exactly the tokens plain decoding would, for greedy and keyed sampling alike. The
classic min(1, p/q) sampler needs a multi-draft rule for siblings and is refused (chains only).

The accepted path's cache rows are then moved to the positions its tokens hold (:func:`path_moves`); the spine's
rows are already in place, so a path along the spine moves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .sampling import SamplingParams, keyed_sample, process_logits

TREE_MAX = 4  # branch rows auto adds to a round at most
TREE_BRANCHES_MAX = 8  # branch rows a request may ask for (``stream(tree=B)``)
TREE_DEPTH = 3  # spine depths a branch may leave at (the shallow ones, where a wrong draft costs the most)


def tree_refusal(params: SamplingParams) -> str | None:
    """Why these sampling parameters cannot verify trees (None: they can)."""
    if params.greedy or params.sampler == "keyed":
        return None
    return ("tree verification is exact for greedy decoding and the keyed sampler; the classic sampler's "
            "min(1, p/q) rule verifies one chain (ask for sampler='keyed', or tree=0)")


def spine_length(parents: np.ndarray) -> int:
    """How many leading nodes form the chain -1, 0, 1, ..: the drafter's spine."""
    s = 0
    while s < len(parents) and parents[s] == s - 1:
        s += 1
    return s


def children(parents: np.ndarray) -> list[list[int]]:
    """kids[r]: the nodes whose parent is row r's (row 0 the root, row i + 1 node i)."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        kids[int(p) + 1].append(i)
    return kids


def walk(out: np.ndarray, tokens: np.ndarray, parents: np.ndarray, params: SamplingParams, position: int,
         ids_only: bool) -> tuple[list[int], int]:
    """The accepted path (nodes, root to leaf) and the target's next token. out: the step's rows, [1 + n] argmax ids
    (``ids_only``) or [1 + n, V] logits; row 0 the root, at sequence ``position`` (its token is the next one)."""
    kids = children(parents)
    path: list[int] = []
    row = 0
    while True:
        if ids_only:
            x = int(out[row])
        elif params.greedy:
            x = int(np.argmax(out[row]))
        else:
            probs = process_logits(out[row: row + 1], params.temperature, params.top_k, params.top_p)[0]
            x = keyed_sample(probs, params.seed, position + len(path))
        nxt = next((c for c in kids[row] if tokens[c] == x), None)
        if nxt is None:
            return path, x
        path.append(nxt)
        row = nxt + 1


def path_moves(path: list[int], base: int) -> tuple[list[int], list[int]]:
    """Cache rows to move after a tree round: node i was written at row base + i, and the path's j-th node belongs at
    row base + j. (sources, destinations); none for a path along the spine."""
    src = [base + node for j, node in enumerate(path) if node != j]
    dst = [base + j for j, node in enumerate(path) if node != j]
    return src, dst


@dataclass
class BranchOdds:
    """How often a branch token (a drafter's runner-up at some depth) is the target's token when it is tested (the
    spine was accepted up to its parent and rejected at its sibling), per bin of the drafter's probability for it.
    Starts from a prior of ``PRIOR`` (at the weight of ``PRIOR_WEIGHT`` tests) in every bin."""

    PRIOR = 0.3
    PRIOR_WEIGHT = 2.0
    BINS = (0.02, 0.05, 0.1, 0.2, 0.35)  # upper edges; the last bin is everything above
    hits: list[float] = field(default_factory=lambda: [BranchOdds.PRIOR * BranchOdds.PRIOR_WEIGHT] * 6)
    tests: list[float] = field(default_factory=lambda: [BranchOdds.PRIOR_WEIGHT] * 6)

    def _bin(self, prob: float) -> int:
        return next((i for i, edge in enumerate(self.BINS) if prob <= edge), len(self.BINS))

    def odds(self, prob: float) -> float:
        b = self._bin(prob)
        return self.hits[b] / self.tests[b]

    def record(self, prob: float, hit: bool) -> None:
        b = self._bin(prob)
        self.tests[b] += 1.0
        self.hits[b] += float(hit)


@dataclass
class Branch:
    """A candidate branch: token ``token`` at spine depth ``depth`` (a sibling of spine node ``depth``), with the
    drafter's probability ``prob`` for it."""

    depth: int
    token: int
    prob: float


def grow(spine: np.ndarray, take: list[Branch]) -> tuple[np.ndarray, np.ndarray]:
    """The tree of a spine and the branches taken (each a leaf whose parent is spine node depth - 1): (tokens,
    parents), spine first."""
    tokens = np.concatenate([spine, np.array([b.token for b in take], dtype=np.int64)])
    parents = np.concatenate([np.arange(-1, len(spine) - 1, dtype=np.int64),
                              np.array([b.depth - 1 for b in take], dtype=np.int64)])
    return tokens, parents


def trie(spine: np.ndarray, others: list[np.ndarray], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The tree of a spine and other continuations of the same context (prompt lookup's other matches), merged where
    they agree: each continuation follows the nodes equal to its tokens and branches off where none is, with at most
    ``rows`` new nodes in all (a continuation cut where they run out). (tokens, parents), spine first; siblings
    never share a token, so the walk's choice of child is unique."""
    tokens = [int(x) for x in spine]
    parents = list(range(-1, len(spine) - 1))
    kids: dict[int, dict[int, int]] = {p: {tokens[p + 1]: p + 1} for p in range(-1, len(spine) - 1)}
    for seq in others:
        node = -1
        for x in (int(v) for v in seq):
            nxt = kids.setdefault(node, {}).get(x)
            if nxt is None:
                if rows <= 0:
                    break
                tokens.append(x)
                parents.append(node)
                nxt = kids[node][x] = len(tokens) - 1
                rows -= 1
            node = nxt
    return np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64)


def branch_gain(b: Branch, reach: list[float], odds: BranchOdds) -> float:
    """Tokens a branch adds to a round, expected: the spine reaches its depth and fails there (reach[d] the chance
    the spine is accepted up to depth d, reach[d + 1] past it), and the branch is the target's token."""
    return (reach[b.depth] - reach[b.depth + 1]) * odds.odds(b.prob)


def reach_of(accept: list[float]) -> list[float]:
    """reach[d]: the chance a spine whose nodes pass with these chances is accepted up to depth d (reach[0] = 1), and
    0 past its end (two extra entries, for branches at and past its last depth)."""
    reach = [1.0]
    for a in accept:
        reach.append(reach[-1] * a)
    return reach + [0.0, 0.0]


def sibling_odds(b: Branch, confs: list[float]) -> float:
    """A branch's chance of being the target's token where the spine fails at its depth, from the draft alone: its
    probability among the tokens other than the spine's."""
    c = confs[b.depth] if b.depth < len(confs) else 0.0
    return min(1.0, b.prob / max(1e-6, 1.0 - c))


def best_branches(branches: list[Branch], reach: list[float], odds, limit: int) -> list[tuple[float, Branch]]:  # noqa: ANN001
    """The ``limit`` branches of the largest expected gain (``odds(branch)``: its chance where tested), best first."""
    scored = [((reach[b.depth] - reach[b.depth + 1]) * odds(b), b) for b in branches]
    scored.sort(key=lambda gb: -gb[0])
    return scored[:limit]


def shape(parents: np.ndarray) -> str:
    """A tree's shape as Stats reports it: spine length + branch rows ("5+2"); a chain is its length."""
    s = spine_length(parents)
    return f"{s}+{len(parents) - s}" if len(parents) > s else str(s)

"""Tree verification: several continuations checked in one step of tree rows, the accepted path's rows moved into
place, greedy and keyed outputs bitwise the plain ones.

The decoder tests drive trees of controlled shape (an oracle drafter that knows the plain output and hides it on a
branch, deep inside a branch's subtree, on the spine or nowhere), so every walk, every row move and every ancestor
mask is exercised; then the real drafters (the draft model's runner-ups, auto) on the same bundle."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.drafters import Proposal, _Stateless
from specedge.runtime.errors import OptionError
from specedge.runtime.manifest import ROWS_KV_MODE
from specedge.runtime.sampling import keyed_sample
from specedge.runtime.trees import (
    TREE_BRANCHES_MAX,
    BranchOdds,
    children,
    path_moves,
    shape,
    spine_length,
    tree_refusal,
    trie,
    walk,
)

PROMPTS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\ndef fib(n):",
    "the cat sat on the mat. the cat sat on the",
    "import numpy as np\nimport numpy as",
]
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the kernels are built with a POSIX C compiler")
PARAMS = {"greedy": SamplingParams(max_new_tokens=40, ignore_eos=True),
          "keyed": SamplingParams(max_new_tokens=40, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)}


# ---------------------------------------------------------------- the walk, on logits made up here
@pytest.mark.fast
def test_the_walk_follows_the_child_equal_to_the_targets_token_and_stops_where_none_is():
    # root -> a(5) -> b(6); root -> c(7) -> d(8); a -> e(9)
    tokens = np.array([5, 6, 7, 8, 9])
    parents = np.array([-1, 0, -1, 2, 0])
    V = 12

    def rows(argmax):  # one logits row per step row (root, then the nodes) with that argmax
        out = np.zeros((len(argmax), V), dtype=np.float32)
        out[np.arange(len(argmax)), argmax] = 1.0
        return out

    g = SamplingParams(max_new_tokens=8)
    # the target says 7 at the root, 8 after c, 3 after d: the path c, d, then 3
    out = rows([7, 0, 0, 8, 3, 0])
    assert walk(out, tokens, parents, g, 10, False) == ([2, 3], 3)
    assert walk(out.argmax(-1), tokens, parents, g, 10, True) == ([2, 3], 3)
    # 5 at the root, 9 after a: e (a leaf) and its row's token
    assert walk(rows([5, 9, 0, 0, 0, 4]), tokens, parents, g, 10, False) == ([0, 4], 4)
    # no child of the root is the target's token: nothing accepted
    assert walk(rows([1, 0, 0, 0, 0, 0]), tokens, parents, g, 10, False) == ([], 1)


@pytest.mark.fast
def test_the_keyed_walk_draws_each_rows_token_at_its_own_position():
    rng = np.random.default_rng(0)
    V, seed, pos = 16, 5, 40
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed)
    logits = rng.normal(size=(4, V)).astype(np.float32) * 3
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x0 = keyed_sample(probs[0], seed, pos)
    x1 = keyed_sample(probs[2], seed, pos + 1)  # the branch's row: the token after x0, one position on
    other = (x0 + 1) % V
    tokens = np.array([other, x0, (x1 + 1) % V])  # spine: a wrong token; a branch with the keyed one, then a leaf
    parents = np.array([-1, -1, 1])
    path, nxt = walk(logits, tokens, parents, params, pos, False)
    assert path == [1] and nxt == x1


@pytest.mark.fast
def test_an_accepted_path_moves_only_the_rows_off_the_spine():
    assert path_moves([0, 1, 2], 50) == ([], [])
    assert path_moves([0, 5], 50) == ([55], [51])
    assert path_moves([4, 6, 7], 50) == ([54, 56, 57], [50, 51, 52])
    assert spine_length(np.array([-1, 0, 1, 0, -1])) == 3
    assert shape(np.array([-1, 0, 1, 0, -1])) == "3+2" and shape(np.array([-1, 0])) == "2"
    assert children(np.array([-1, 0, -1])) == [[0, 2], [1], [], []]


@pytest.mark.fast
def test_the_classic_sampler_is_refused_trees_and_branch_odds_learn():
    assert tree_refusal(SamplingParams()) is None
    assert tree_refusal(SamplingParams(temperature=0.8, sampler="keyed")) is None
    assert "keyed" in tree_refusal(SamplingParams(temperature=0.8, sampler="classic"))
    odds = BranchOdds()
    assert odds.odds(0.5) == pytest.approx(BranchOdds.PRIOR)
    for _ in range(20):
        odds.record(0.5, True)
    assert odds.odds(0.5) > 0.9 and odds.odds(0.01) == pytest.approx(BranchOdds.PRIOR)


# ---------------------------------------------------------------- the decoder, on a tiny rows bundle
@pytest.fixture(scope="module")
def rows_bundle(tmp_path_factory, tiny_llama, tiny_draft):
    from specedge.export.bundle import ExportOptions, export_bundle
    from specedge.export.quant import WeightFormat

    opts = ExportOptions(k=4, max_context=192, prefill_chunk=16, kv_mode=ROWS_KV_MODE,
                         weights=WeightFormat("int4", form="specedge"))
    return export_bundle(tiny_llama, tiny_draft, tmp_path_factory.mktemp("tree-bundle") / "b", opts).out


@pytest.fixture(scope="module")
def dec(rows_bundle):
    return SpecDecoder.load(rows_bundle)


class OracleTrees(_Stateless):
    """Trees built around the plain output ``ref`` (prompt + output ids): each round the correct continuation sits
    on the spine up to a random depth j, then (by the draw) on a branch at depth j that goes on for a few correct
    tokens under it (so a path's rows lie off the spine and out of order), or nowhere; wrong leaves everywhere."""

    name = "oracle-trees"

    def __init__(self, ref: list[int], vocab: int, seed: int = 0):
        self.ref, self.vocab, self.rng = ref, vocab, np.random.default_rng(seed)
        self.taken = 0  # rounds whose plain continuation was put off the spine

    def wrong(self, at: int) -> int:
        return int((self.ref[at] + 1 + self.rng.integers(self.vocab - 1)) % self.vocab) if at < len(self.ref) \
            else int(self.rng.integers(self.vocab))

    def right(self, at: int) -> int:
        return self.ref[at] if at < len(self.ref) else 0

    def propose(self, tokens, k, params, rng):  # noqa: ANN001
        n = len(tokens)
        if k <= 0:
            return Proposal(np.zeros(0, dtype=np.int64), None)
        s = int(self.rng.integers(1, k + 1))  # spine length
        j = int(self.rng.integers(0, s + 1))  # the spine's correct prefix
        toks = [self.right(n + i) if i < j else self.wrong(n + i) for i in range(s)]
        pars = list(range(-1, s - 1))
        if j < s and self.rng.random() < 0.7:  # the right token on a branch at depth j, a correct chain under it
            self.taken += 1
            for _ in range(int(self.rng.integers(0, 2))):  # a wrong sibling before it
                toks.append(self.wrong(n + j))
                pars.append(j - 1)
            parent = j - 1
            for i in range(j, min(k, j + 1 + int(self.rng.integers(0, 3)))):
                toks.append(self.right(n + i))
                pars.append(parent)
                parent = len(toks) - 1
                if self.rng.random() < 0.5:  # a wrong leaf beside the chain
                    toks.append(self.wrong(n + i + 1))
                    pars.append(parent)
        return Proposal(np.array(toks, dtype=np.int64), None, np.array(pars, dtype=np.int64))


def plain(dec, prompt, params):
    r = dec.generate(prompt, params, drafter="none")
    return dec.encode_prompt(prompt) + r.token_ids, r.token_ids


@pytest.mark.parametrize("mode", ["greedy", "keyed"])
def test_oracle_trees_decode_bitwise_the_plain_tokens(dec, mode, monkeypatch):
    params = PARAMS[mode]
    for seed, prompt in enumerate(PROMPTS):
        ref, want = plain(dec, prompt, params)
        rows = dec.target.kv[:, :, 0, :, : len(ref) - 1].copy()  # the cache rows plain decoding left
        oracle = OracleTrees(ref, dec.manifest.target.dims.vocab, seed)
        monkeypatch.setattr(dec, "make_drafter", lambda kind=None, o=oracle: o)
        r = dec.generate(prompt, params, drafter="auto", reuse_prefix=False)
        assert r.token_ids == want, (mode, prompt)
        # every committed token's K/V row in place, bitwise the chain's: the moves put each path where it belongs
        assert np.array_equal(dec.target.kv[:, :, 0, :, : len(ref) - 1], rows), (mode, prompt)
        st = r.stats
        assert st.tree_rounds >= st.rounds - 1 and st.branched > 0 and oracle.taken >= st.branched
        assert st.accepted > st.rounds  # paths of several tokens, off the spine too
        assert st.resyncs == 0  # the next round finds the rows the tree round left: nothing fed again
        monkeypatch.undo()


def test_tree_rows_are_the_chain_rows_when_the_path_leaves_the_spine(dec, monkeypatch):
    """A path through a branch: the next round reads the moved rows. Wrong drafts everywhere else, so every token
    after the first round comes from rows that a move put in place (or the plain rows after them)."""
    params = PARAMS["greedy"]
    ref, want = plain(dec, PROMPTS[0], params)

    class BranchOnly(OracleTrees):
        def propose(self, tokens, k, params, rng):  # noqa: ANN001
            n = len(tokens)
            if k < 2:
                return Proposal(np.zeros(0, dtype=np.int64), None)
            # spine: right, wrong; branch under the root's child: right, right (nodes 2, 3 -> rows n+1, n+2)
            toks = [self.right(n), self.wrong(n + 1), self.right(n + 1)] + ([self.right(n + 2)] if k > 2 else [])
            return Proposal(np.array(toks, dtype=np.int64), None, np.array([-1, 0, 0, 2][: len(toks)]))

    oracle = BranchOnly(ref, dec.manifest.target.dims.vocab)
    monkeypatch.setattr(dec, "make_drafter", lambda kind=None: oracle)
    r = dec.generate(PROMPTS[0], params, drafter="auto")
    assert r.token_ids == want
    assert r.stats.branched > 5 and r.stats.accepted > 2 * r.stats.branched


@pytest.mark.parametrize("mode", ["greedy", "keyed"])
@pytest.mark.parametrize("drafter,tree", [("model", 1), ("model", 3), ("auto", None), ("auto", 4), ("hybrid", 2)])
def test_the_drafters_trees_decode_bitwise_the_plain_tokens(dec, mode, drafter, tree):
    params = PARAMS[mode]
    for prompt in PROMPTS:
        _, want = plain(dec, prompt, params)
        r = dec.generate(prompt, params, drafter=drafter, tree=tree)
        assert r.token_ids == want, (mode, drafter, tree, prompt)
        if drafter == "model":  # a fixed tree every round there is a runner-up to branch on
            assert r.stats.tree_rounds > 0
            assert all(int(s.split("+")[1]) <= tree for s in r.stats.tree_shapes if "+" in s)


def test_tree_zero_keeps_chains(dec):
    r = dec.generate(PROMPTS[0], PARAMS["greedy"], drafter="model", tree=0)
    assert r.stats.tree_rounds == 0


def test_bad_tree_requests_are_refused_with_what_is_allowed(dec, bundles):
    for bad in (-1, TREE_BRANCHES_MAX + 1, True, "2", 1.5):
        with pytest.raises(OptionError, match=f"0..{TREE_BRANCHES_MAX}"):
            dec.generate(PROMPTS[0], PARAMS["greedy"], drafter="model", tree=bad)
    with pytest.raises(OptionError, match="keyed"):
        dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=4, temperature=0.8, sampler="classic"),
                     drafter="model", tree=2)
    with pytest.raises(OptionError, match="drafts nothing"):
        dec.generate(PROMPTS[0], PARAMS["greedy"], drafter="none", tree=2)
    portable = SpecDecoder.load(bundles["model"])  # kv_mode portable: no tree rows
    with pytest.raises(OptionError, match="row-addressed"):
        portable.generate(PROMPTS[0], PARAMS["greedy"], drafter="model", tree=2)
    # auto keeps chains where trees cannot run, and says nothing
    assert portable.generate(PROMPTS[0], PARAMS["greedy"], drafter="auto").stats.tree_rounds == 0


def test_a_batched_decoder_refuses_trees(rows_bundle):
    dec = SpecDecoder.load(rows_bundle, max_batch=2)
    with pytest.raises(OptionError, match="max_batch 1"):
        dec.generate(PROMPTS[0], PARAMS["greedy"], drafter="model", tree=2)


@pytest.mark.fast
def test_runner_ups_are_the_next_best_tokens_with_the_drafts_probabilities():
    from types import SimpleNamespace

    from specedge.runtime.drafters import ModelDrafter
    from specedge.runtime.sampling import keyed_exponentials

    rng = np.random.default_rng(3)
    logits = rng.normal(size=50).astype(np.float32) * 2
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-logits)
    plain = SimpleNamespace(head_ids=None)
    got = ModelDrafter._runner_ups(plain, logits, float(probs.max()), None, None, 1, int(order[0]), 2)
    assert [b.token for b in got] == order[1:3].tolist() and all(b.depth == 1 for b in got)
    assert [b.prob for b in got] == pytest.approx(probs[order[1:3]].tolist(), rel=1e-5)
    # keyed: the next best scores q / E, the drawn token (the best) left out
    noise = keyed_exponentials(9, 33, 50)
    q = probs[None].astype(np.float64)
    score = q[0] / noise
    best = np.argsort(-score)
    got = ModelDrafter._runner_ups(plain, logits, float(q.max()), q, noise, 0, int(best[0]), 3)
    assert [b.token for b in got] == best[1:4].tolist()
    assert [b.prob for b in got] == pytest.approx(q[0, best[1:4]].tolist())
    # a draft head: ids of the target's vocabulary, scores of the head's
    head = SimpleNamespace(head_ids=np.arange(100, 150))
    got = ModelDrafter._runner_ups(head, logits, float(probs.max()), None, None, 0, 100 + int(order[0]), 1)
    assert [b.token for b in got] == [100 + int(order[1])]


def test_spec_run_bench_compares_trees_and_reports_their_shapes(rows_bundle, bundles, tmp_path):
    from click.testing import CliRunner

    from specedge.runtime.cli import main as run_cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "the cat sat on the mat. the cat sat on the", "raw": true, "suite": "mine"}\n')
    args = ["--prompts", str(prompts), "--drafter", "model,auto", "--k", "3", "--max-new-tokens", "12", "--no-plots",
            "--verify", "size"]
    r = CliRunner().invoke(run_cli, ["bench", str(rows_bundle), *args, "--tree", "default,2", "--out",
                                     str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    table = (tmp_path / "b" / "report.md").read_text()
    for config in ("model:tree2 | 3", "auto:tree2 | 4", "model | 3", "auto | 4"):
        assert f"| mine | {config} |" in table
    row = next(line for line in table.splitlines() if line.startswith("| mine | model:tree2 | 3 |"))
    assert "3+2:" in row and "| 1/1 |" in row  # the tree's shape, and the same tokens as plain
    runs = json.loads((tmp_path / "b" / "results.json").read_text())["runs"]
    assert {r["tree"] for r in runs} == {None, 2} and all("tree_shapes" in r for r in runs)
    # a bundle without tree rows is refused before anything is measured, and so is a tree too wide
    r = CliRunner().invoke(run_cli, ["bench", str(bundles["model"]), *args, "--tree", "2", "--out",
                                     str(tmp_path / "c")])
    assert r.exit_code == 2 and "row-addressed" in r.output and not (tmp_path / "c" / "results.json").exists()
    r = CliRunner().invoke(run_cli, ["bench", str(rows_bundle), *args, "--tree", "9", "--out", str(tmp_path / "d")])
    assert r.exit_code == 2 and "0..8" in r.output


@pytest.mark.fast
def test_other_continuations_merge_into_the_spine_where_they_agree():
    tokens, parents = trie(np.array([1, 2, 3]), [np.array([1, 2, 4, 5]), np.array([1, 6]), np.array([1, 2, 4, 7])], 9)
    assert tokens.tolist() == [1, 2, 3, 4, 5, 6, 7] and parents.tolist() == [-1, 0, 1, 1, 3, 0, 3]
    # the rows run out: a continuation is cut, the next ones find no room
    tokens, parents = trie(np.array([1, 2]), [np.array([1, 5, 6, 7]), np.array([8])], 2)
    assert tokens.tolist() == [1, 2, 5, 6] and parents.tolist() == [-1, 0, 0, 2]
    assert all(len(set(tokens[np.flatnonzero(parents == p)].tolist())) == (parents == p).sum() for p in range(-1, 4))


def test_prompt_lookup_branches_to_other_matches_continuations():
    from specedge.runtime.drafters import PromptLookupDrafter

    d = PromptLookupDrafter(8, 1)
    d.tree, d.tree_nodes = 3, 20
    # "a b" was followed by "c d" most recently and by "x y" before: the chain c d .., a branch x y under the root
    context = np.array([10, 11, 20, 21, 5, 10, 11, 12, 13, 6, 10, 11])
    prop = d.propose(context, 2, SamplingParams(), None)
    assert prop.tokens.tolist() == [12, 13, 20, 21] and prop.parents.tolist() == [-1, 0, -1, 2]
    d.tree = 0
    assert d.propose(context, 2, SamplingParams(), None).parents is None


LOOKUP_PROMPTS = ["the cat sat on the mat. the cat ran to the door. the dog sat on the mat. the cat",
                  "x = f(a)\ny = g(a)\nx = f(b)\ny = h(b)\nx = f(c)\ny ="]


@pytest.mark.parametrize("mode", ["greedy", "keyed"])
def test_prompt_lookup_trees_decode_bitwise_the_plain_tokens(dec, mode, monkeypatch):
    from specedge.runtime.drafters import PromptLookupDrafter

    params = PARAMS[mode]
    rounds = 0
    # one-token matches (ngram_min 1): a random model's text has few longer ones, and every match has siblings
    wants = [plain(dec, prompt, params)[1] for prompt in LOOKUP_PROMPTS + PROMPTS]
    monkeypatch.setattr(dec, "make_drafter", lambda kind=None: PromptLookupDrafter(8, 1))
    for prompt, want in zip(LOOKUP_PROMPTS + PROMPTS, wants):
        for tree in (1, 4):
            r = dec.generate(prompt, params, drafter="prompt-lookup", tree=tree)
            assert r.token_ids == want, (mode, tree, prompt)
            assert r.stats.resyncs == 0
            rounds += r.stats.tree_rounds
    assert rounds > 0

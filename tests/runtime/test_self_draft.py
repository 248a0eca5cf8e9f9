"""Self drafts: the target's own layers, without some, as the draft, sharing the target's weights and KV cache.

The graph cut is checked against an independent construction (a target exported from the same model with those
layers removed computes the same bits), the decoder against plain decoding (greedy and keyed, every drafter, trees,
streams that take turns on the cache), the sharing against the files and the memory plan, and the search and the
refusals through the command line."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from specedge.export.self_draft import SELF_GRAPH, format_layers, parse_skip, with_self_draft
from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.errors import OptionError
from specedge.runtime.manifest import ROWS_KV_MODE, read_manifest, write_manifest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the kernels are built with a POSIX C compiler")
LAYERS = 4
SKIP = (1, 2)
PROMPTS = ["def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\ndef fib(n):",
           "the cat sat on the mat. the cat sat on the", "import numpy as np\nimport numpy as"]
PARAMS = {"greedy": SamplingParams(max_new_tokens=40, ignore_eos=True),
          "keyed": SamplingParams(max_new_tokens=40, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)}


def opts(**kw):  # noqa: ANN003
    from specedge.export.bundle import ExportOptions
    from specedge.export.quant import WeightFormat

    return ExportOptions(k=4, max_context=192, prefill_chunk=16, kv_mode=ROWS_KV_MODE,
                         weights=WeightFormat("int4", form="specedge"), **kw)


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    from tests.conftest import make_hf_model

    return make_hf_model(tmp_path_factory.mktemp("deep") / "m", "llama", layers=LAYERS, seed=3)


@pytest.fixture(scope="module")
def self_bundle(tmp_path_factory, deep_model):
    from specedge.export.bundle import export_bundle

    return export_bundle(deep_model, f"self:{format_layers(SKIP)}", tmp_path_factory.mktemp("self") / "b",
                         opts()).out


@pytest.fixture(scope="module")
def dec(self_bundle):
    d = SpecDecoder.load(self_bundle)
    yield d
    d.close()


# ---------------------------------------------------------------- the layer list
@pytest.mark.fast
def test_skip_lists_parse_and_print_back_and_bad_ones_say_what_is_allowed():
    assert parse_skip("3,5-7, 9", 12) == (3, 5, 6, 7, 9)
    assert format_layers((3, 5, 6, 7, 9)) == "3,5-7,9"
    assert parse_skip(format_layers((0, 1, 2, 10)), 12) == (0, 1, 2, 10)
    for bad, why in (("12", "outside"), ("4-2", "outside"), ("x", "layer numbers"), ("0-11", "keep at least one"),
                     ("", "layer numbers")):
        with pytest.raises(OptionError, match=why):
            parse_skip(bad, 12)


# ---------------------------------------------------------------- the graph cut
def test_the_self_draft_computes_what_a_target_without_those_layers_computes(self_bundle, deep_model, tmp_path):
    """An independent construction: the same model with the skipped layers removed (its weights copied), exported as
    a target. Fed the same tokens from an empty cache, the self draft (whose rows are then its own) gives its bits."""
    import torch
    from transformers import AutoModelForCausalLM

    from specedge.export.bundle import export_bundle

    full = AutoModelForCausalLM.from_pretrained(deep_model)
    full.model.layers = torch.nn.ModuleList([m for i, m in enumerate(full.model.layers) if i not in SKIP])
    full.config.num_hidden_layers = LAYERS - len(SKIP)
    for i, layer in enumerate(full.model.layers):
        layer.self_attn.layer_idx = i
    cut = tmp_path / "cut"
    full.save_pretrained(cut)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (cut / f).write_bytes((deep_model / f).read_bytes())
    ref = SpecDecoder.load(export_bundle(cut, "none", tmp_path / "cut-bundle", opts()).out)
    dec = SpecDecoder.load(self_bundle)
    try:
        ids = dec.encode_prompt(PROMPTS[0], chat=False)[:24]
        for pos, t in enumerate(ids):
            got = dec.draft_runner.step([t], pos, all_logits=False)[0].copy()
            want = ref.target.step([t], pos, all_logits=False)[0]
            assert np.array_equal(got, want), pos
        # and the target's own logits are not those: layers really were skipped
        assert not np.array_equal(dec.target.step(ids, 0, all_logits=False)[0], got)
    finally:
        dec.close()
        ref.close()


def test_the_draft_has_no_weights_of_its_own(self_bundle):
    m = read_manifest(self_bundle)
    assert m.draft.is_self and m.draft.layers == tuple(i for i in range(LAYERS) if i not in SKIP)
    assert m.draft.weights == m.target.weights
    own = set(m.files) - {m.target.graph, m.target.weights, "tokenizer.json"}
    assert own == {SELF_GRAPH}, own
    assert m.files[SELF_GRAPH]["bytes"] < m.files[m.target.weights]["bytes"] / 4  # a graph, not weights
    from specedge.runtime.memplan import plan_for_manifest

    plan = plan_for_manifest(m, "ort-cpu")
    draft = next(p for p in plan.models if p.role == "draft")
    assert sum(draft.weights.values()) == 0 and draft.kv == 0


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads the process's mappings (Linux)")
def test_both_sessions_take_the_weights_read_once_and_neither_maps_the_file(self_bundle):
    m = read_manifest(self_bundle)
    data = self_bundle / m.target.weights
    assert m.draft.tensors == m.target.tensors  # every tensor of the target's file
    dec = SpecDecoder.load(self_bundle, threads=1)
    try:
        assert dec.draft_runner is not None
        maps = Path("/proc/self/maps").read_text()
        assert str(data.resolve()) not in maps and data.name not in maps
    finally:
        dec.close()


def test_spec_export_plan_shows_no_weight_bytes_for_a_self_draft(self_bundle):
    from click.testing import CliRunner

    from specedge.export.cli import main

    r = CliRunner().invoke(main, ["plan", str(self_bundle), "--json"])
    models = {m["role"]: m for m in json.loads(r.output)["models"]}
    assert sum(v for k, v in models["draft"].items() if k.startswith("weights_")) == 0
    assert sum(v for k, v in models["target"].items() if k.startswith("weights_")) > 0


def test_a_bench_report_names_the_layers_and_counts_no_bytes_of_its_own(dec):
    from specedge.runtime.bench.runner import bundle_info

    info = bundle_info(dec)
    draft = info["models"]["draft"]
    assert draft["weights_bytes"] == 0 and draft["kv_bytes"] == 0
    assert draft["self_layers"] == [i for i in range(LAYERS) if i not in SKIP]
    assert info["models"]["target"]["weights_bytes"] > 0 and info["models"]["target"]["self_layers"] == []


def test_serve_decodes_one_request_at_a_time_by_default_with_a_self_draft(self_bundle):
    from specedge.runtime.server import default_max_batch

    assert default_max_batch(str(self_bundle), "auto") == 1  # a self draft shares one sequence's cache


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("mode", sorted(PARAMS))
@pytest.mark.parametrize("drafter", ["model", "auto", "hybrid"])
def test_self_drafted_outputs_are_bitwise_the_plain_ones(dec, mode, drafter):
    params = PARAMS[mode]
    for prompt in PROMPTS:
        plain = dec.generate(prompt, params, drafter="none", chat=False)
        got = dec.generate(prompt, params, drafter=drafter, k=4, chat=False)
        assert got.token_ids == plain.token_ids, (drafter, mode, prompt)


@pytest.mark.parametrize("mode", sorted(PARAMS))
def test_self_drafted_trees_are_bitwise_the_plain_ones(dec, mode):
    params = PARAMS[mode]
    for prompt in PROMPTS:
        plain = dec.generate(prompt, params, drafter="none", chat=False)
        got = dec.generate(prompt, params, drafter="model", k=3, tree=2, chat=False)
        assert got.token_ids == plain.token_ids
        assert got.stats.tree_rounds > 0


def test_a_draft_that_runs_every_layer_is_always_accepted(self_bundle, tmp_path):
    """No layer skipped: the draft is the target itself on the target's rows, so every drafted token is accepted;
    a row the draft wrote that the verify step did not rewrite, or a cache row it read that was not the target's,
    would show as a rejection (greedy is exact either way)."""
    import shutil

    b = tmp_path / "b"
    shutil.copytree(self_bundle, b)
    m = read_manifest(b)
    write_manifest(b, with_self_draft(b, dataclasses.replace(m, draft=None, drafter="none"), ()))
    d = SpecDecoder.load(b)
    try:
        for prompt in PROMPTS:
            r = d.generate(prompt, PARAMS["greedy"], drafter="model", k=4, chat=False)
            assert r.stats.accepted == r.stats.drafted > 0
            assert r.token_ids == d.generate(prompt, PARAMS["greedy"], drafter="none", chat=False).token_ids
    finally:
        d.close()


def test_streams_that_take_turns_on_the_shared_cache_stay_exact(dec):
    """Two streams interleaved round by round: each one's rounds write the cache the other's drafts read."""
    params = PARAMS["greedy"]
    want = [dec.generate(p, params, drafter="none", chat=False).token_ids for p in PROMPTS[:2]]
    streams = [dec.stream(p, params, drafter="model", k=4, chat=False) for p in PROMPTS[:2]]
    got: list[list[int]] = [[], []]
    live = [True, True]
    while any(live):
        for i, s in enumerate(streams):
            if live[i]:
                ev = next(s, None)
                if ev is None:
                    live[i] = False
                else:
                    got[i] += ev.token_ids
    assert got == want


# ---------------------------------------------------------------- refusals
def test_a_self_draft_is_refused_where_it_cannot_share(self_bundle, deep_model, tmp_path):
    from specedge.export.bundle import ExportOptions, export_bundle

    with pytest.raises(OptionError, match="max_batch 1"):
        SpecDecoder.load(self_bundle, max_batch=2)
    with pytest.raises(OptionError, match="specedge form"):
        export_bundle(deep_model, "self:1", tmp_path / "fp32", ExportOptions(k=4, max_context=192, prefill_chunk=16))
    with pytest.raises(OptionError, match="outside"):
        export_bundle(deep_model, "self:9", tmp_path / "bad", opts())


def test_the_search_prints_what_it_tried_and_apply_gives_the_bundle_its_choice(deep_model, tmp_path):
    from click.testing import CliRunner

    from specedge.export.bundle import export_bundle
    from specedge.export.cli import main

    b = export_bundle(deep_model, "none", tmp_path / "b", opts()).out
    r = CliRunner().invoke(main, ["self-search", str(b), "--tokens", "12", "--apply"])
    assert r.exit_code == 0, r.output
    for i in range(LAYERS):
        assert f"skip {i:>3}: alpha" in r.output
    assert "best: --draft self:" in r.output and "self draft set to" in r.output
    m = read_manifest(b)
    assert m.draft.is_self and m.drafter == "model"
    d = SpecDecoder.load(b)
    try:
        plain = d.generate(PROMPTS[1], PARAMS["greedy"], drafter="none", chat=False)
        assert d.generate(PROMPTS[1], PARAMS["greedy"], drafter="model", chat=False).token_ids == plain.token_ids
    finally:
        d.close()
    model = export_bundle(deep_model, deep_model, tmp_path / "with-model", opts()).out
    r = CliRunner().invoke(main, ["self-search", str(model)])
    assert r.exit_code == 2 and "draft model" in r.output

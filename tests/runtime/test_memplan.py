"""Memory plan: weight counts agree with what an export writes, the verdict follows the board, and
`spec-export plan` / `build --backend trt` print it and refuse what cannot fit."""

from __future__ import annotations

import json

from click.testing import CliRunner

from specedge.export import cli as export_cli
from specedge.runtime import memplan
from specedge.runtime.manifest import read_manifest
from specedge.runtime.memplan import Board, GiB, plan_for_manifest


def test_weight_count_matches_the_exported_fp32_graph(bundles):
    b = bundles["model"]
    m = read_manifest(b, verify="none")
    p = plan_for_manifest(m, "ort-cpu")
    for mp, entry in zip(p.models, (m.target, m.draft)):
        written = (b / entry.weights).stat().st_size
        counted = sum(mp.weights.values())
        assert abs(counted - written) / written < 0.1, (mp.role, counted, written)  # + RoPE tables, masks


def test_verdicts_follow_the_board(bundles):
    m = read_manifest(bundles["model"], verify="none")
    assert plan_for_manifest(m, "trt", "fp16", board=None).verdict()[0] == "unknown"
    big = plan_for_manifest(m, "trt", "fp16", board=Board("big", 64, True, 2))
    assert big.verdict()[0] == "fits" and big.process >= memplan.CUDA_CONTEXT_BYTES
    total = big.total / GiB
    assert (plan_for_manifest(m, "trt", "fp16", board=Board("small", total * 0.9, True, 0)).verdict()[0]
            == "does not fit")
    assert plan_for_manifest(m, "trt", "fp16", board=Board("tight", total * 1.1, True, 0)).verdict()[0] == "tight"
    # fp16 engines halve the linear weights of the fp32 export; the CPU plan has no CUDA context
    cpu = plan_for_manifest(m, "ort-cpu")
    assert big.models[0].weights["linear"] < 0.6 * cpu.models[0].weights["linear"] and cpu.process < big.process


def test_plan_cli_for_a_bundle_and_a_board_file(bundles, tmp_path):
    board = tmp_path / "tiny.toml"
    board.write_text('[board]\nname = "tiny"\nmemory_gb = 0.01\nunified = true\nreserved_gb = 0\n')
    r = CliRunner().invoke(export_cli.main, ["plan", str(bundles["model"]), "--board", str(board), "--backend", "trt"])
    assert r.exit_code == 1 and "DOES NOT FIT" in r.output and "target" in r.output and "draft" in r.output
    r = CliRunner().invoke(export_cli.main, ["plan", str(bundles["model"]), "--json", "--backend", "ort-cpu"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["models"][0]["role"] == "target"
    r = CliRunner().invoke(export_cli.main, ["plan", "no-such-thing"])
    assert r.exit_code != 0 and "neither a bundle directory nor a preset" in r.output


def test_trt_build_refuses_what_cannot_fit_before_building(bundles, monkeypatch):
    from specedge.runtime.backends import trt

    monkeypatch.setattr(memplan, "this_machine", lambda: Board("tiny", 0.05, True, 0))
    monkeypatch.setattr(trt, "import_tensorrt", lambda: object())  # as if TensorRT were installed
    r = CliRunner().invoke(export_cli.main, ["build", str(bundles["model"]), "--backend", "trt"])
    assert r.exit_code != 0 and "will not fit this machine" in r.output and "--no-memory-check" in r.output


def test_a_preset_plan_counts_the_even_verify_widths_an_int4_export_declares(monkeypatch):
    """cpu exports int4 with K=8; where its 4-bit blocks go to MatMulNBits (no C compiler here) the bundle's widest
    verify width is 10, not 9 (manifest.model_widths)."""
    import types

    import specedge.export.fetch as fetch
    import specedge.export.loaders as loaders
    from specedge.runtime.manifest import ModelDims

    dims = ModelDims(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128, vocab=100)
    monkeypatch.setattr(fetch, "resolve_model", lambda name, progress=None: name)
    monkeypatch.setattr(loaders, "load_source",
                        lambda path: types.SimpleNamespace(config=types.SimpleNamespace(dims=dims, max_positions=4096)))
    seen = {}
    monkeypatch.setattr(memplan, "plan_models", lambda models, **kw: seen.setdefault("models", models))
    monkeypatch.setattr(memplan, "context_that_fits", lambda models, own, board, **kw: own)
    monkeypatch.setenv("CC", "/nonexistent/cc")  # quant_form auto -> matmulnbits, as the export would choose
    export_cli._plan_of("cpu", None, None, None, None)
    (role, _, fmt, widest_t, widest_l), draft = seen["models"]  # the preset's 0.5B draft is planned too
    assert (role, fmt, widest_t, widest_l) == ("target", "int4", 64, 10)  # prefill 64; verify K+1 = 9 -> 10
    assert (draft[0], draft[2], draft[3]) == ("draft", "int4", 64)  # the widest draft width: prefill P


def test_the_default_context_is_the_models_own_halved_until_the_board_holds_it():
    """context_that_fits: the models' own context where it fits, halved while the board cannot hold it (never
    below 2048, or the models' own where that is less); fp16 KV holds twice the context of fp32 in the same memory."""
    from specedge.runtime.manifest import ModelDims
    from specedge.runtime.memplan import CONTEXT_FLOOR, context_that_fits, kv_bytes

    d = ModelDims(n_layers=28, hidden=1536, n_heads=12, n_kv_heads=2, head_dim=128, ffn=8960, vocab=151936)
    models = [("target", d, "int4", 64, 64)]
    big = Board("big", 64.0, False, 1.0)
    assert context_that_fits(models, 32768, big) == 32768
    assert context_that_fits(models, 32768, None) == 32768
    assert context_that_fits(models, 1024, Board("tiny", 0.1, False, 0.0)) == 1024  # its own, less than the floor
    assert context_that_fits(models, 32768, Board("tiny", 0.1, False, 0.0)) == CONTEXT_FLOOR
    # a board that holds the plan at 8k with fp32 KV and half of that KV to spare: 16k fp32 does not fit, 16k fp16
    # (the same KV bytes as 8k fp32) does, and int8 (d + 4 bytes a row) reaches 32k
    at_8k = memplan.plan_models(models, max_context=8192, backend="ort-cpu", precision="fp32", head="fp32",
                                what="").total
    board = Board("mid", (at_8k + kv_bytes(d, 8192, "float32", 64)[0] / 2) / 0.85 / GiB + 1.0, False, 1.0)
    assert context_that_fits(models, 32768, board) == 8192
    assert context_that_fits(models, 32768, board, kv_dtype="float16") == 16384
    assert context_that_fits(models, 32768, board, kv_dtype="int8") == 32768
    assert kv_bytes(d, 1024, "int8", 64)[0] * 4 * 128 == kv_bytes(d, 1024, "float32", 64)[0] * 132

"""tools/long_context.py and tools/long_prompts.py over a tiny bundle in the CPU profile's form (fp16 KV, rows):
the tables they print, and the refusals of what cannot run."""

from __future__ import annotations

import sys

import pytest

from .tools_loader import load_tool


@pytest.fixture(scope="module")
def fp16_bundle(tmp_path_factory, tiny_llama, tiny_draft):
    from specedge.export.bundle import ExportOptions, export_bundle
    from specedge.export.profiles import kernels_buildable
    from specedge.export.quant import WeightFormat

    if kernels_buildable() is not None:
        pytest.skip(f"specedge's kernels cannot be built here: {kernels_buildable()}")
    opts = ExportOptions(k=4, max_context=256, prefill_chunk=16, kv_mode="rows", kv_dtype="float16",
                         weights=WeightFormat("int4", form="specedge"))
    return export_bundle(tiny_llama, tiny_draft, tmp_path_factory.mktemp("lc") / "b", opts).out


def run(tool: str, monkeypatch, *args: str) -> int:
    mod = load_tool(tool)
    monkeypatch.setattr(sys, "argv", [tool, *args])
    return mod.main()


def test_long_context_prints_the_step_by_depth_and_the_ttft(fp16_bundle, monkeypatch, capsys):
    assert run("long_context", monkeypatch, str(fp16_bundle), "--depths", "8,200", "--ttft", "100", "--repeats",
               "1", "--verify") == 0
    out = capsys.readouterr().out
    assert "KV float16, S_max 256, kv_mode rows, K=4" in out and "Machine: " in out
    rows = [line for line in out.splitlines() if line.startswith("| 8 |") or line.startswith("| 200 |")]
    assert len(rows) == 2 and rows[0].split("|")[3].strip() == "1.00×", rows
    ttft = [line for line in out.splitlines() if line.startswith("| ") and "|---" not in line][-1]
    assert 90 <= int(ttft.split("|")[1]) <= 120 and float(ttft.split("|")[2]) > 0, ttft


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_long_context_writes_the_rows_its_steps_read_and_no_others(dtype):
    """Rows never written are the zero page: a step over them would read cache, not memory."""
    from types import SimpleNamespace

    import numpy as np

    lc = load_tool("long_context")
    width = 8 + (4 if dtype == "int8" else 0)
    kv = np.zeros((3, 2, 2, 2, 40, width), dtype=dtype)  # layers, k|v, slots, heads, S_max, row
    lc.fill_cache(SimpleNamespace(target=SimpleNamespace(kv=kv)), 25)
    written = kv[:, :, 0, :, :25]
    assert not kv[:, :, 1].any() and not kv[:, :, 0, :, 25:].any()
    if dtype == "int8":
        scales = np.ascontiguousarray(written[..., 8:]).view("<f4")
        assert (scales == np.float32(1 / 127)).all() and (np.abs(written[..., :8]) <= 127).all()
        assert (written[..., :8] != 0).mean() > 0.9
    else:
        assert np.isfinite(written).all() and (written != 0).all()


def test_long_context_refuses_depths_past_the_context_and_a_half_peer(fp16_bundle, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        run("long_context", monkeypatch, str(fp16_bundle), "--depths", "8,254", "--ttft", "none")
    assert "[254] do not fit the bundle's context S_max=256" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run("long_context", monkeypatch, str(fp16_bundle), "--gguf", "m.gguf")
    assert "--llama-bin and --gguf go together" in capsys.readouterr().err


def test_long_prompts_checks_every_drafter_against_plain(fp16_bundle, monkeypatch, capsys, tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def area(r):\n    return 3.14159 * r * r\n\n\nprint(area(2), area(3))\n")
    assert run("long_prompts", monkeypatch, str(fp16_bundle), "--file", str(src), "--rename", "area=disc_area",
               "--question-tokens", "60", "--max-new-tokens", "12", "--drafters", "prompt-lookup,auto,model") == 0
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| edit") or line.startswith("| question")]
    assert [(r[1].strip(), r[3].strip()) for r in rows] == [
        (p, d) for p in ("edit", "question") for d in ("none", "prompt-lookup", "auto", "model")]
    assert all(r[8].strip().startswith("yes") for r in rows), out
    with pytest.raises(SystemExit, match="has no 'radius' to rename"):
        run("long_prompts", monkeypatch, str(fp16_bundle), "--file", str(src), "--rename", "radius=r")


def test_kv_accuracy_compares_the_next_tokens_of_two_caches(fp16_bundle, tmp_path_factory, tiny_llama, tiny_draft,
                                                            monkeypatch, capsys):
    from specedge.export.bundle import ExportOptions, export_bundle
    from specedge.export.quant import WeightFormat

    opts = ExportOptions(k=4, max_context=256, prefill_chunk=16, kv_mode="rows", kv_dtype="float32",
                         weights=WeightFormat("int4", form="specedge"))
    fp32 = export_bundle(tiny_llama, tiny_draft, tmp_path_factory.mktemp("kv32") / "b", opts).out
    args = ["--suites", "chat,code", "--per-suite", "1", "--max-new-tokens", "8"]
    assert run("kv_accuracy", monkeypatch, str(fp32), str(fp32), *args) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r[1].strip() for r in rows[1:]] == ["chat", "code", "all"], rows
    assert rows[-1][4].strip() == "100.00%" and rows[1][6].strip() == "0.00e+00"  # a bundle against itself
    assert rows[-1][5].strip() == "0 of 0"
    assert run("kv_accuracy", monkeypatch, str(fp32), str(fp16_bundle), str(fp32), *args) == 0
    out = capsys.readouterr().out
    assert "(KV float32), other" in out and "(KV float16)" in out
    chat = [line.split("|") for line in out.splitlines() if line.startswith("| chat")]
    assert len(chat) == 2 and float(chat[0][6]) > 0 and float(chat[1][6]) == 0  # fp16, then the reference itself


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resident memory from /proc/self/status")
def test_plan_rss_sets_the_plan_beside_the_memory_every_kv_row_holds(fp16_bundle, monkeypatch, capsys):
    """The tool writes a page of every KV buffer of both models, as many bytes as the plan counts for their caches,
    and prints the resident memory at each stage."""
    from specedge.runtime.manifest import read_manifest
    from specedge.runtime.memplan import plan_for_manifest

    assert run("plan_rss", monkeypatch, str(fp16_bundle), "--max-batch", "2") == 0
    out = capsys.readouterr().out
    assert "--max-batch 2" in out and out.startswith("Machine: ")
    rows = {r[1].strip(): r for r in (line.split("|") for line in out.splitlines() if line.startswith("| "))}
    assert list(rows) == ["loaded", "after a request", "every KV row written"], rows
    assert all(float(r[2].split()[0]) > 0 for r in rows.values()), rows
    plan = plan_for_manifest(read_manifest(fp16_bundle), "ort-cpu", max_batch=2)
    assert f"KV buffers written: {sum(m.kv for m in plan.models)} bytes" in out, out

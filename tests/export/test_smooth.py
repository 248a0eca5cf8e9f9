"""Activation smoothing for the integer-GEMM form: the calibration forward pass against transformers, and the
smoothed weights computing the same function."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from specedge.export.loaders import load_source
from specedge.export.smooth import activation_maxima, smoothed, smoothing_factors

IDS = [5, 17, 3, 90, 41, 41, 7, 12, 63, 2, 88, 30, 19, 5, 17, 3]


@pytest.fixture(scope="module")
def qwen_biased(tmp_path_factory):
    """A tiny qwen2 whose q/k/v biases are not zero (transformers initializes them to zero): the v bias is folded."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..conftest import make_hf_model

    path = make_hf_model(tmp_path_factory.mktemp("qwenb") / "m", "qwen2", seed=2, tie=True)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    torch.manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("model", ["tiny_llama", "qwen_biased"])
def test_calibration_maxima_match_transformers(model, request):
    """max |x| per channel at the inputs of q|k|v, o, gate|up and down, against forward hooks on the transformers
    model (RoPE, GQA, the q/k/v bias of qwen2, causal attention)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(model)
    ref = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    seen: dict[str, np.ndarray] = {}

    def hook(key):
        def f(_mod, args):
            seen[key] = args[0][0].abs().amax(0).detach().numpy()
        return f

    for i, layer in enumerate(ref.model.layers):
        layer.self_attn.q_proj.register_forward_pre_hook(hook(f"l{i}.qkv_in"))
        layer.self_attn.o_proj.register_forward_pre_hook(hook(f"l{i}.o_in"))
        layer.mlp.gate_proj.register_forward_pre_hook(hook(f"l{i}.gate_up_in"))
        layer.mlp.down_proj.register_forward_pre_hook(hook(f"l{i}.down_in"))
    with torch.no_grad():
        ref(torch.tensor([IDS]))
    got = activation_maxima(load_source(path), IDS)
    assert set(got) == set(seen)
    for key, want in seen.items():
        np.testing.assert_allclose(got[key], want, rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.mark.parametrize("model", ["tiny_llama", "qwen_biased"])
def test_smoothed_weights_compute_the_same_model(model, request, tmp_path):
    """Folding the factors into the norms, q|k|v, v (+ bias), o, gate|up and down leaves the fp32 model's logits
    unchanged (to float rounding), while the factors are far from 1: the transformation is exact, not a no-op."""
    from specedge.export.graph import build_model_graph
    from specedge.runtime.manifest import io_spec

    src = load_source(request.getfixturevalue(model))
    factors = smoothing_factors(src, activation_maxima(src, IDS), alpha=0.5)
    spread = np.concatenate([np.log(f) for f in factors.values()])
    assert spread.std() > 0.3
    d = src.config.dims

    def logits(s, name):
        path, _, _ = build_model_graph(s, tmp_path, name, max_positions=64)
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        inputs, _ = io_spec(d, "portable")
        feed = {}
        for spec in inputs:
            if spec.name == "input_ids":
                feed[spec.name] = np.array([IDS], np.int64)
            elif spec.name == "past_len":
                feed[spec.name] = np.zeros([1], np.int64)
            elif spec.name == "logits_at":
                feed[spec.name] = np.arange(len(IDS), dtype=np.int64)[None]
            else:
                feed[spec.name] = np.zeros([{"B": 1, "S_max": 64}.get(x, x) for x in spec.shape], np.float32)
        return sess.run(["logits"], feed)[0]

    a, b = logits(src, "plain"), logits(smoothed(src, factors), "smoothed")
    assert np.abs(a - b).max() < 1e-4 * max(1.0, np.abs(a).max())

"""GGUF loading: a tiny model written with gguf.GGUFWriter loads to the weights transformers' GGUF loader gives."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from specedge.export.loaders import load_source
from specedge.runtime.errors import BundleError, UnsupportedModelError

Q = gguf.GGMLQuantizationType


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation (what the loader must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def quantize_k(t: np.ndarray, qt) -> np.ndarray:
    """float [N, K] (K a multiple of 256) -> GGUF Q4_K, Q6_K, Q5_K, Q3_K, Q2_K or IQ4_XS rows, uint8 [N, K/256 *
    bytes]: round-to-nearest under ggml's block layouts (gguf-py reads these types but cannot write them). Tests
    only: not llama.cpp's search."""
    n, k = t.shape
    x = t.astype(np.float32).reshape(n, k // 256, 256)
    if qt == Q.Q6_K:
        sub = x.reshape(n, -1, 16, 16)
        scale = np.abs(sub).max(-1) / 31.0  # [n, sb, 16]
        d = _f16(np.abs(scale).max(-1) / 127.0).astype(np.float32)  # [n, sb]
        sc = np.where(d[..., None] > 0, np.rint(scale / np.where(d > 0, d, 1)[..., None]), 0).clip(-128, 127)
        step = d[..., None] * sc
        q = ((np.rint(sub / np.where(step > 0, step, 1)[..., None]) + 32).clip(0, 63).astype(np.uint8)
             .reshape(n, -1, 256))
        ql, qh = [], []
        for h in range(2):
            a, b, c, e = (q[..., 128 * h + 32 * i: 128 * h + 32 * i + 32] for i in range(4))
            ql += [(a & 15) | ((c & 15) << 4), (b & 15) | ((e & 15) << 4)]
            qh.append((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6))
        parts = [*ql, *qh, sc.astype(np.int8).view(np.uint8), _f16(d)[..., None].view(np.uint8)]
    elif qt == Q.Q4_K:
        sub = x.reshape(n, -1, 8, 32)
        mn = np.maximum(-sub.min(-1), 0.0)  # w = d sc q - dmin m, q in 0..15
        scale = (sub.max(-1) + mn) / 15.0
        d, dmin = (_f16(v.max(-1) / 63.0).astype(np.float32) for v in (scale, mn))
        sc = (np.where(d[..., None] > 0, np.rint(scale / np.where(d > 0, d, 1)[..., None]), 0)
              .clip(0, 63).astype(np.uint8))
        m = (np.where(dmin[..., None] > 0, np.rint(mn / np.where(dmin > 0, dmin, 1)[..., None]), 0)
             .clip(0, 63).astype(np.uint8))
        step = d[..., None] * sc
        q = np.rint((sub + (dmin[..., None] * m)[..., None]) / np.where(step > 0, step, 1)[..., None]).clip(0, 15)
        q = q.astype(np.uint8)  # [n, sb, 8, 32]
        packed_sc = np.concatenate([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                                    (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
                                    (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)
        qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(n, -1, 128)
        parts = [_f16(d)[..., None].view(np.uint8), _f16(dmin)[..., None].view(np.uint8), packed_sc, qs]
    elif qt in (Q.Q5_K, Q.Q2_K):  # w = d sc q - dmin m: Q5_K 32-blocks, 6-bit sc/m, q 0..31; Q2_K 16s, 4-bit, 0..3
        blk, top, qmax = (32, 63, 31) if qt == Q.Q5_K else (16, 15, 3)
        sub = x.reshape(n, -1, 256 // blk, blk)
        mn = np.maximum(-sub.min(-1), 0.0)
        scale = (sub.max(-1) + mn) / qmax
        d, dmin = (_f16(v.max(-1) / top).astype(np.float32) for v in (scale, mn))
        sc, m = (np.where(f[..., None] > 0, np.rint(v / np.where(f > 0, f, 1)[..., None]), 0).clip(0, top)
                 .astype(np.uint8) for v, f in ((scale, d), (mn, dmin)))
        step = d[..., None] * sc
        q = (np.rint((sub + (dmin[..., None] * m)[..., None]) / np.where(step > 0, step, 1)[..., None])
             .clip(0, qmax).astype(np.uint8))
        if qt == Q.Q5_K:
            packed_sc = np.concatenate([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                                        (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
                                        (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)
            qh = sum(((q[..., i, :] >> 4) & 1) << i for i in range(8)).astype(np.uint8)  # [n, sb, 32]
            qs = ((q[..., 0::2, :] & 15) | ((q[..., 1::2, :] & 15) << 4)).reshape(n, -1, 128)
            parts = [_f16(d)[..., None].view(np.uint8), _f16(dmin)[..., None].view(np.uint8), packed_sc, qh, qs]
        else:  # element 128h + 32j + l at bits 2j of qs[32h + l]
            e = q.reshape(n, -1, 2, 4, 32)
            qs = sum(e[..., j, :] << (2 * j) for j in range(4)).astype(np.uint8).reshape(n, -1, 64)
            parts = [sc | (m << 4), qs, _f16(d)[..., None].view(np.uint8), _f16(dmin)[..., None].view(np.uint8)]
    elif qt == Q.Q3_K:  # w = d (sc - 32) q, q in -4..3, 16-blocks, sc 6-bit
        sub = x.reshape(n, -1, 16, 16)
        scale = np.abs(sub).max(-1) / 4.0
        d = _f16(scale.max(-1) / 31.0).astype(np.float32)
        sc = np.where(d[..., None] > 0, np.rint(scale / np.where(d > 0, d, 1)[..., None]), 0).clip(0, 31)
        step = d[..., None] * sc
        q3 = np.rint(sub / np.where(step > 0, step, 1)[..., None]).clip(-4, 3) + 4
        q3 = q3.astype(np.uint8).reshape(n, -1, 256)
        s6 = (sc + 32).astype(np.uint8)  # [n, sb, 16]
        hmask = sum(((q3[..., 32 * i: 32 * i + 32] >> 2) & 1) << i for i in range(8)).astype(np.uint8)
        e = (q3 & 3).reshape(n, -1, 2, 4, 32)
        qs = sum(e[..., j, :] << (2 * j) for j in range(4)).astype(np.uint8).reshape(n, -1, 64)
        low = (s6[..., :8] & 15) | ((s6[..., 8:] & 15) << 4)
        high = sum(((s6[..., 4 * i: 4 * i + 4] >> 4) & 3) << (2 * i) for i in range(4)).astype(np.uint8)
        parts = [hmask, qs, low, high, _f16(d)[..., None].view(np.uint8)]
    elif qt == Q.IQ4_XS:  # w = d (ls - 32) kvalues[i], 32-blocks, ls 6-bit
        sub = x.reshape(n, -1, 8, 32)
        scale = np.abs(sub).max(-1) / 127.0
        d = _f16(scale.max(-1) / 31.0).astype(np.float32)
        ls = (np.where(d[..., None] > 0, np.rint(scale / np.where(d > 0, d, 1)[..., None]), 0).clip(0, 31) + 32)
        idx = _iq4_indices(sub, d[..., None] * (ls - 32))
        ls = ls.astype(np.uint16)
        parts = [_f16(d)[..., None].view(np.uint8),
                 sum((ls[..., i] >> 4) << (2 * i) for i in range(8)).astype(np.uint16)[..., None].view(np.uint8),
                 ((ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4)).astype(np.uint8),
                 (idx[..., :16] | (idx[..., 16:] << 4)).reshape(n, -1, 128)]
    else:
        raise ValueError(qt)
    return np.concatenate([p.reshape(n, k // 256, -1).astype(np.uint8) for p in parts], axis=-1).reshape(n, -1)


def _iq4_indices(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The codebook index nearest each value of x [.., 32] at its block's step [..] -> uint8 [.., 32]."""
    from specedge.export.quant import IQ4_LEVELS

    return np.abs(x[..., None] - step[..., None, None] * IQ4_LEVELS).argmin(-1).astype(np.uint8)


def quantize_iq4_nl(t: np.ndarray) -> np.ndarray:
    """float [N, K] (K a multiple of 32) -> GGUF IQ4_NL rows: w = d kvalues[i] per 32 values, nearest index."""
    n, k = t.shape
    x = t.astype(np.float32).reshape(n, k // 32, 32)
    d = _f16(np.abs(x).max(-1) / 127.0)
    idx = _iq4_indices(x, d.astype(np.float32))
    rows = np.concatenate([d[..., None].view(np.uint8), idx[..., :16] | (idx[..., 16:] << 4)], axis=-1)
    return rows.reshape(n, -1)


def quantize_test(t: np.ndarray, qt) -> np.ndarray:
    """float [N, K] -> GGUF rows of ggml type qt: gguf-py's quantizer where it has one, else the tests' own."""
    if qt == Q.IQ4_NL:
        return quantize_iq4_nl(t)
    if qt in (Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q3_K, Q.Q2_K, Q.IQ4_XS):
        return quantize_k(t, qt)
    return quantize(t, qt)


def write_tiny_gguf(hf_dir, path, qtypes):
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    sd = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # the tiny tokenizer is ByteLevel with the GPT-2 regex
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {a["content"]: a["id"] for a in tok["added_tokens"]}
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in added else 1 for t, _ in vocab])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in sd.items():
        if name in names:
            gname = names[name]
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{layer[rest.rsplit('.', 1)[0]]}.weight"
        t = t.astype(np.float32)
        if gname.endswith("attn_q.weight"):
            t = permute(t, cfg["num_attention_heads"])
        elif gname.endswith("attn_k.weight"):
            t = permute(t, cfg["num_key_value_heads"])
        qt = qtypes.get(gname.split(".")[-2], Q.F32) if t.ndim == 2 else Q.F32
        if qt == Q.F32:
            w.add_tensor(gname, t)
        else:
            w.add_tensor(gname, quantize_test(t, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtypes", [
    {},
    {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_0,
     "token_embd": Q.Q8_0},
], ids=["f32", "q8_0-q4_0-q4_1"])
def test_gguf_matches_transformers_loader(tiny_llama, tmp_path, qtypes):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_llama, path, qtypes)
    src = load_source(path)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name).eval()
    sd = {k: v.float().numpy() for k, v in ref.state_dict().items()}
    assert src.config.family.name == "llama"
    np.testing.assert_array_equal(src.get("embed"), sd["model.embed_tokens.weight"])
    for i in range(src.config.dims.n_layers):
        for ours, theirs in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                             ("o", "self_attn.o_proj"), ("up", "mlp.up_proj"), ("down", "mlp.down_proj"),
                             ("attn_norm", "input_layernorm")):
            np.testing.assert_allclose(src.get(f"l{i}.{ours}"), sd[f"model.layers.{i}.{theirs}.weight"],
                                       rtol=0, atol=1e-6, err_msg=f"layer {i} {ours}")
    if not qtypes:  # f32: the un-permuted weights are the original HF weights, bit for bit
        from safetensors.numpy import load_file

        orig = load_file(str(tiny_llama / "model.safetensors"))
        np.testing.assert_array_equal(src.get("l0.q"), orig["model.layers.0.self_attn.q_proj.weight"])


def test_unreadable_gguf_is_refused(tmp_path):
    p = tmp_path / "broken.gguf"
    p.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(BundleError, match="not a readable GGUF"):
        load_source(p)


def test_unknown_architecture_is_refused(tmp_path):
    p = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(p), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="supported"):
        load_source(p)


# ---- files whose counts, layout or configuration lie: each must be refused cleanly, never a runaway allocation, a
# traceback or a silently broken export


def test_a_gguf_array_count_past_the_end_of_the_file_is_refused_at_once(tiny_llama, tmp_path):
    import struct
    import time

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_llama, path, {})
    data = bytearray(path.read_bytes())
    key = b"tokenizer.ggml.token_type"
    at = data.index(key) + len(key) + 8  # past the value type (array) and the element type (int32): the count
    data[at: at + 8] = struct.pack("<Q", 1 << 60)
    path.write_bytes(bytes(data))
    t0 = time.perf_counter()
    with pytest.raises(BundleError, match=r"'tokenizer.ggml.token_type' \(1152921504606846976 values\) .* runs past "
                                          r"the end of the file"):
        load_source(path)  # gguf's reader looped here, 50 MB a second, until the machine ran out
    assert time.perf_counter() - t0 < 10


def test_tensors_that_overlap_or_leave_the_alignment_are_refused():
    from types import SimpleNamespace as N

    from specedge.export.loaders import check_gguf_layout

    class Reader:
        fields: dict = {}

        def __init__(self, *spans):
            self.tensors = [N(name=f"t{i}", data_offset=o, n_bytes=n) for i, (o, n) in enumerate(spans)]

    path = N(stat=lambda: N(st_size=1024))
    check_gguf_layout(path, Reader((0, 64), (64, 32), (96, 32)))
    with pytest.raises(BundleError, match="'t0' and 't1' overlap"):  # a type changed: its bytes run into the next
        check_gguf_layout(path, Reader((0, 96), (64, 32)))
    with pytest.raises(BundleError, match="not on the file alignment 32"):
        check_gguf_layout(path, Reader((0, 64), (65, 32)))
    with pytest.raises(BundleError, match="past the end of the file"):
        check_gguf_layout(path, Reader((992, 64)))


def _edited_hf(tiny_llama, tmp_path, edit_config=None, rows=None):
    import shutil

    from safetensors.numpy import load_file, save_file

    d = tmp_path / "hf"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    if rows is not None:  # fewer embedding rows than the tokenizer has ids, the config saying so
        sd = load_file(str(d / "model.safetensors"))
        sd = {k: (v[:rows] if k in ("model.embed_tokens.weight", "lm_head.weight") else v) for k, v in sd.items()}
        save_file(sd, str(d / "model.safetensors"))
        cfg["vocab_size"] = rows
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(num_hidden_layers=1), r"tensor 'l1\.attn_norm' is beyond the 1 layers"),
    (lambda c: c.update(num_hidden_layers=4), r"declares 4 layers, and tensors \['l2\.attn_norm'"),
    (lambda c: c.update(hidden_size=c["hidden_size"] * 2), r"tensor 'embed' has shape"),
    (lambda c: c.update(vocab_size=c["vocab_size"] + 7), r"tensor 'embed' has shape"),
    (lambda c: c.update(rms_norm_eps=-1.0), r"norm epsilon -1\.0 must be finite and > 0"),
    (lambda c: c.update(num_attention_heads=0), r"n_heads must be an int in 1\.\.4194304, got 0"),
    (lambda c: c.pop("num_attention_heads"), r"cannot be read as a model \(KeyError: 'num_attention_heads'\)"),
])
def test_a_configuration_that_contradicts_the_tensors_is_refused_before_export(tiny_llama, tmp_path, edit, message):
    with pytest.raises(BundleError, match=message):
        load_source(_edited_hf(tiny_llama, tmp_path, edit))


def test_a_truncated_safetensors_file_and_a_tokenizer_past_the_embedding_are_refused(tiny_llama, tmp_path):
    from specedge.export.bundle import ExportOptions, export_bundle

    d = _edited_hf(tiny_llama, tmp_path, rows=100)
    with pytest.raises(BundleError, match=r"has 100 embedding rows and its tokenizer \d+ ids"):
        export_bundle(d, "prompt-lookup", tmp_path / "out", ExportOptions(max_context=64, prefill_chunk=16))
    assert not (tmp_path / "out").exists()
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises(BundleError, match="lies past the end of the file"):
        load_source(d)

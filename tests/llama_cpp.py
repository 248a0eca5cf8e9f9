"""llama.cpp's own files for tests: its source as the llama-cpp-python sdist on PyPI carries it (vocabulary test
vectors, ``convert_hf_to_gguf.py`` with its ``conversion`` package and ``gguf-py``), extracted once into the specedge
cache; and a tiny Hugging Face model converted to GGUF by that converter, the reference no one here wrote."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from specedge.export.fetch import cache_root

SDIST = "llama-cpp-python==0.3.36"
_VENDOR = "/vendor/llama.cpp/"

# The converter, run on a tiny model whose tokenizer is a byte-level BPE trained for the tests: llama.cpp
# recognizes a tokenizer by the hash of its output on a fixed text and refuses one it does not know, and reads
# SentencePiece (not installed here) before it looks for a tokenizer.model (Gemma 2's only SentencePiece). These are
# bypassed; the weights, their names, permutations and every hyperparameter key are the converter's own.
_DRIVER = """
import runpy, sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base, gemma

def no_sentencepiece(self, *a, **k):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    raise RuntimeError("a SentencePiece tokenizer needs the sentencepiece package")

known_pre = base.TextModel.get_vocab_base_pre

def pre(self, tokenizer):
    try:
        return known_pre(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"  # the tests' tokenizer: byte-level BPE, GPT-2's pre-tokenizer

base.TextModel._create_vocab_sentencepiece = no_sentencepiece
base.TextModel.get_vocab_base_pre = pre
# Gemma 2's vocabulary is read as SentencePiece only: the tests' BPE goes as Gemma 3's does without a tokenizer.model
gemma.Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def llama_cpp_files(name: str, keep: Callable[[str], bool]) -> Path:
    """The sdist's vendored llama.cpp members for which ``keep(path inside llama.cpp)`` holds, under
    ``<cache>/<name>/`` with their relative paths; downloaded and extracted on first use (the test skips, saying
    why, where PyPI cannot be reached)."""
    d = cache_root() / name
    done = d / ".complete"
    if done.is_file():
        return d
    dl = d / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    if not any(dl.glob("*.tar.gz")):
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "-q",
                            "-d", str(dl), SDIST], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"could not download {SDIST} (llama.cpp's source): {r.stderr[-300:]}")
    with tarfile.open(next(dl.glob("*.tar.gz"))) as tar:
        for m in tar.getmembers():
            at = m.name.find(_VENDOR)
            if m.isfile() and at >= 0 and keep(rel := m.name[at + len(_VENDOR):]):
                out = d / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(tar.extractfile(m).read())
    for f in dl.iterdir():
        f.unlink()
    dl.rmdir()
    done.write_text(SDIST)
    return d


def converter_dir() -> Path:
    return llama_cpp_files("llama-cpp-convert", lambda rel: rel == "convert_hf_to_gguf.py"
                           or rel.startswith(("conversion/", "gguf-py/gguf/")))


def convert_hf_to_gguf(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """``hf_dir`` converted by llama.cpp's ``convert_hf_to_gguf.py`` (outtype f32, f16, bf16 or q8_0)."""
    src = converter_dir()
    r = subprocess.run([sys.executable, "-c", _DRIVER, str(src), str(hf_dir), "--outfile", str(out),
                        "--outtype", outtype], capture_output=True, text=True)
    assert r.returncode == 0, f"llama.cpp's converter failed on {hf_dir}:\n{r.stderr[-3000:]}"
    return out


def requantize_gguf(src: Path, out: Path, qtype_of: Callable[[str], object]) -> Path:
    """``src`` (an f32 GGUF) rewritten with every 2-D tensor in the ggml type ``qtype_of(tensor name)`` returns
    (``gguf.GGMLQuantizationType``; F32 keeps it): every metadata key copied as it is, as llama.cpp's
    ``gguf_new_metadata.py`` does. The blocks come from gguf-py's quantizers (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the
    tests' round-to-nearest writers for the rest (``test_gguf.quantize_test``), not from llama.cpp's search."""
    import gguf

    from .export.test_gguf import quantize_test

    Q = gguf.GGMLQuantizationType
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        data = np.asarray(t.data)
        qt = qtype_of(t.name) if len(t.shape) == 2 else Q.F32
        if qt == Q.F32 or t.tensor_type != Q.F32:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
            continue
        rows = data.reshape(int(t.shape[1]), int(t.shape[0]))
        raw = quantize_test(rows, qt)
        w.add_tensor(t.name, raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out

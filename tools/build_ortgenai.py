#!/usr/bin/env python3
"""onnxruntime-genai as a peer of tools/bench_peers.py (``--peers ortgenai``): build its models from the GGUFs our
bundles come from, and run its own generator loop on our prompt token ids.

Everything here runs in a separate venv (onnxruntime-genai, torch, transformers), so our own venv needs none of it:

    python3 tools/build_ortgenai.py venv                   # ~/.cache/specedge/peers-venv (idempotent)
    python3 tools/build_ortgenai.py build smollm2-135m     # or a .gguf path, or a Hugging Face folder
    python3 tools/build_ortgenai.py build qwen2.5-coder-1.5b --precision int4 --lm-head int8
    python3 tools/build_ortgenai.py pair TARGET_DIR DRAFT_DIR   # a draft-model speculation config over two builds
    python3 tools/build_ortgenai.py generate < job.json         # a whole job: JSON in, JSON out
    python3 tools/build_ortgenai.py serve                       # bench_peers.py drives this: JSON lines, one
                                                                # prompt at a time, models kept loaded

Run with any python3: the commands other than ``venv`` re-execute themselves in the peers venv. ``build`` and
``pair`` print what they do on stderr and the built folder as the last line of stdout. Outputs are cached (reused when
the source file and the options are unchanged) under ``$SPECEDGE_CACHE`` (default ``~/.cache/specedge``)
``/ortgenai/<model>/<variant>/``; ``<model>`` is the model's folder in the GGUF cache (``smollm2-135m``) or the file
stem, ``<variant>`` spells the options (``int4-b32-a4-head-int8-emb-f32``).

Why not hand the GGUF to the builder (``python -m onnxruntime_genai.models.builder -i file.gguf``): in 0.18 it reads
the config and tokenizer from ``-m`` (a Hugging Face hub name: no hub here, it fails with
``LocalTokenNotFoundError``), and its GGUF loader (``models/loaders/gguf.py``) takes float16/float32 GGUFs only: it
reshapes each tensor's raw bytes, so a quantized GGUF fails, e.g. SmolLM2's Q4_1 ``attn_k``:
``RuntimeError: shape '[192, 576]' is invalid for input of size 69120`` (20 bytes per 32 weights). So ``build``
first makes a Hugging Face folder from the GGUF with transformers (``from_pretrained(dir, gguf_file=...)``
de-quantizes to fp32; saved as safetensors with the tokenizer), then runs the builder on that folder
(``-i hf -p int4 -e cpu``) and deletes the folder (``--keep-hf`` keeps it).

Weight format, by default matched to our quantized bundles (tools/bench_peers.py passes the bundle's settings):
MatMulNBits, block 32, accuracy level 4, symmetric; lm_head int8 (``matmul_mixed_precision=last_matmul:int8``);
embedding a float gather (``op_types_to_quantize=MatMul shared_embeddings=false``: the builder's default for a model
that ties its embeddings is an int4 GatherBlockQuantized sharing the lm_head's int4 weights). ``--genai-defaults``
keeps the builder's own choices (int4 lm_head shared with the embedding). Unlike our export, which carries GGUF blocks
over exactly where MatMulNBits can hold them, the builder re-quantizes the de-quantized weights (round to nearest).
The built ``genai_config.json`` gets ``intra_op_num_threads`` (``--threads``, default 2) and
``inter_op_num_threads`` 1 in the decoder's session options; ``generate`` can override the threads per run.

Speculation in onnxruntime-genai 0.18 (docs/SpeculativeDecoding.md of microsoft/onnxruntime-genai, read at a
0.16-dev snapshot; the 0.18.0 wheel has the same options and messages, and runs both on CPU here): ``speculative``
options of ``GeneratorParams``/``genai_config.json``, strategy picked per Generator (src/decoding_strategy.cpp):
n-gram decoding (``ngram_size`` N = match the last N-1 committed tokens, ``max_draft_tokens`` K, fixed when
``min_adaptive_k`` is 0) and base (draft-model) speculative decoding (a ``model.draft`` decoder block in
``genai_config.json`` beside ``model.decoder``; ``max_draft_tokens`` K). Batch 1, greedy or sampling; n-gram needs
per-token logits (the builder's default; ``prune_lm_head`` would break it), draft-model verifies them in one batch.
Each ``generate_next_token`` hands out one token; a speculative round runs whole inside the call that starts it.
0.18 rejects ``..`` in config file names, so ``pair`` makes a folder with symlinks ``target/`` and ``draft/``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CACHE = Path(os.environ.get("SPECEDGE_CACHE", Path.home() / ".cache" / "specedge"))
VENV = Path(os.environ.get("SPECEDGE_PEERS_VENV", CACHE / "peers-venv"))
ROOT = CACHE / "ortgenai"
GENAI_SPEC = "onnxruntime-genai==0.18.*"
PACKAGES = [GENAI_SPEC, "torch==2.13.0", "transformers", "accelerate", "onnx", "onnx_ir", "gguf", "sentencepiece",
            "tokenizers", "safetensors"]
KNOWN = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")  # spec-export fetch names
STAMP = "specedge_build.json"


def say(s: str) -> None:
    print(f"[ortgenai] {s}", file=sys.stderr, flush=True)


def die(s: str) -> None:
    print(f"[ortgenai] error: {s}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def venv_python() -> Path:
    return VENV / "bin" / "python"


def _in_peers_env() -> bool:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return False
    return True


def ensure_env() -> None:
    """Re-execute in the peers venv unless this interpreter already has onnxruntime_genai."""
    if _in_peers_env():
        return
    py = venv_python()
    if not py.exists():
        die(f"onnxruntime-genai is not importable here and there is no peers venv at {VENV}: "
            f"run `python3 {Path(__file__).name} venv` first")
    if Path(sys.prefix).resolve() == VENV.resolve():
        die(f"the peers venv {VENV} has no onnxruntime_genai: run `python3 {Path(__file__).name} venv`")
    os.execv(str(py), [str(py), os.path.abspath(__file__), *sys.argv[1:]])


# ---------------------------------------------------------------- venv


def cmd_venv(a) -> None:
    py = venv_python()
    if not py.exists():
        base = shutil.which("python3.11") or sys.executable
        say(f"creating {VENV} with {base}")
        subprocess.run([base, "-m", "venv", str(VENV)], check=True)
    pkgs = PACKAGES if not a.genai else [f"onnxruntime-genai=={a.genai}", *PACKAGES[1:]]
    say(f"pip install {' '.join(pkgs)}")
    subprocess.run([str(py), "-m", "pip", "install", "-q", *pkgs], check=True)
    out = subprocess.run([str(py), "-c", "import onnxruntime_genai as og, onnxruntime as ort, torch, transformers;"
                          "print(og.__version__, ort.__version__, torch.__version__, transformers.__version__)"],
                         check=True, capture_output=True, text=True).stdout.split()
    say(f"onnxruntime-genai {out[0]}, onnxruntime {out[1]}, torch {out[2]}, transformers {out[3]}")
    print(py)


# ---------------------------------------------------------------- build


def _spec_export() -> str | None:
    if os.environ.get("SPECEDGE_EXPORT"):
        return os.environ["SPECEDGE_EXPORT"]
    here = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "spec-export"
    return str(here) if here.exists() else shutil.which("spec-export")


def resolve_source(src: str) -> tuple[Path, str]:
    """(GGUF file or Hugging Face folder, cache key)."""
    p = Path(src).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            die(f"{p} is a folder without config.json (not a Hugging Face model folder)")
        return p.resolve(), p.name.lower()
    if p.suffix == ".gguf":
        if not p.exists():
            die(f"no such GGUF file: {p}")
        p = p.resolve()
        key = p.parent.name if p.parent.parent == (CACHE / "models").resolve() else p.stem
        return p, key.lower()
    if src in KNOWN:
        hits = sorted((CACHE / "models" / src).glob("*.gguf"))
        if not hits:
            exe = _spec_export()
            if exe is None:
                die(f"{src}: not in {CACHE / 'models'} and no spec-export to fetch it "
                    "(set $SPECEDGE_EXPORT or run `spec-export fetch {src}` in the project's venv)")
            say(f"fetching {src} with {exe}")
            path = subprocess.run([exe, "fetch", src], check=True, capture_output=True, text=True).stdout.split()[-1]
            hits = [Path(path)]
        return hits[0].resolve(), src
    die(f"{src!r}: give a .gguf file, a Hugging Face folder, or one of {', '.join(KNOWN)}")
    raise AssertionError


def variant_name(a) -> str:
    if a.precision == "fp32":
        return "fp32"
    sym = "" if a.symmetric else "-asym"
    if a.genai_defaults:
        return f"{a.precision}-b{a.block}-a{a.accuracy_level}{sym}-genai-defaults"
    return f"{a.precision}-b{a.block}-a{a.accuracy_level}{sym}-head-{a.lm_head}-emb-f32"


def extra_options(a) -> list[str]:
    if a.precision == "fp32":
        return []
    opts = [f"block_size={a.block}", f"accuracy_level={a.accuracy_level}",
            f"is_symmetric={'true' if a.symmetric else 'false'}"]
    if not a.genai_defaults:
        opts += ["op_types_to_quantize=MatMul", "shared_embeddings=false"]  # float embedding gather, like ours
        if a.lm_head == "fp32":
            opts.append("nodes_to_exclude=/lm_head/MatMul")
        elif a.lm_head != a.precision:
            opts.append(f"matmul_mixed_precision=last_matmul:{a.lm_head}")
    return opts + list(a.extra_option or [])


def _versions() -> dict:
    import onnxruntime
    import onnxruntime_genai as og

    v = {"onnxruntime_genai": og.__version__, "onnxruntime": onnxruntime.__version__}
    for mod in ("torch", "transformers", "onnx", "gguf"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - only informative
            pass
    return v


def _source_id(src: Path) -> dict:
    st = src.stat()
    return {"path": str(src), "bytes": st.st_size if src.is_file() else None, "mtime_ns": st.st_mtime_ns}


def make_hf(src: Path, hf: Path) -> None:
    """De-quantize a GGUF to a Hugging Face folder (fp32 safetensors + tokenizer) with transformers."""
    stamp = hf / "specedge_hf.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("source") == _source_id(src):
        say(f"Hugging Face folder cached: {hf}")
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = hf.with_name(hf.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    say(f"de-quantizing {src.name} to fp32 with transformers -> {hf}")
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    # the weights are plain fp32 now; transformers still tags the model as "gguf-quantized", which blocks saving
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "specedge_hf.json").write_text(json.dumps({"source": _source_id(src)}))
    del model
    gc.collect()
    shutil.rmtree(hf, ignore_errors=True)
    tmp.rename(hf)
    say(f"  done in {time.time() - t0:.0f} s, {_du(hf) / 1e9:.2f} GB")


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _graph_summary(model_onnx: Path) -> dict:
    import onnx

    m = onnx.load(str(model_onnx), load_external_data=False)
    ops: dict[str, int] = {}
    nbits: dict[str, int] = {}
    out: dict = {}
    for n in m.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
        attrs = {x.name: x.i for x in n.attribute}
        if n.op_type == "MatMulNBits":
            key = f"int{attrs.get('bits')}-b{attrs.get('block_size')}-a{attrs.get('accuracy_level')}"
            nbits[key] = nbits.get(key, 0) + 1
            if "lm_head" in n.name:
                out["lm_head"] = key
        if "embed_tokens" in n.name and n.op_type in ("Gather", "GatherBlockQuantized"):
            out["embedding"] = n.op_type + (f" int{attrs.get('bits')}" if "bits" in attrs else "")
    out["matmulnbits"] = nbits
    out["ops"] = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:12])
    return out


def set_threads(cfg_path: Path, threads: int) -> None:
    cfg = json.loads(cfg_path.read_text())
    for block in ("decoder", "draft"):
        if block in cfg["model"]:
            so = cfg["model"][block].setdefault("session_options", {})
            so["intra_op_num_threads"] = threads
            so["inter_op_num_threads"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=4))


def build(a) -> Path:
    import resource

    src, key = resolve_source(a.source)
    root = ROOT / key
    out = root / variant_name(a)
    want = {"source": _source_id(src), "precision": a.precision, "extra_options": extra_options(a)}
    if (out / STAMP).exists():
        have = json.loads((out / STAMP).read_text())
        if {k: have.get(k) for k in want} == want:
            say(f"cached: {out}")
            if have.get("threads") != a.threads:
                set_threads(out / "genai_config.json", a.threads)
                have["threads"] = a.threads
                (out / STAMP).write_text(json.dumps(have, indent=1))
            return out
        say(f"{out} was built from other inputs/options: rebuilding")
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    hf = src if src.is_dir() else root / "hf"
    if not src.is_dir():
        make_hf(src, hf)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(tmp), "-p", a.precision,
           "-e", "cpu", "-c", str(root / "builder-cache")]
    opts = extra_options(a)
    if opts:
        cmd += ["--extra_options", *opts]
    say("$ " + " ".join(cmd))
    log = root / f"{out.name}.build.log"
    t1 = time.time()
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if r.returncode != 0 or not (tmp / "model.onnx").exists():
        tail = log.read_text().splitlines()[-25:]
        die(f"the model builder failed (rc {r.returncode}); full log {log}; last lines:\n" + "\n".join(tail))
    builder_s = time.time() - t1
    set_threads(tmp / "genai_config.json", a.threads)
    shutil.rmtree(root / "builder-cache", ignore_errors=True)
    stamp = {**want, "threads": a.threads, "variant": out.name, "versions": _versions(),
             "graph": _graph_summary(tmp / "model.onnx"), "bytes": _du(tmp),
             "seconds_total": round(time.time() - t0, 1),
             "seconds_builder": round(builder_s, 1),
             "peak_rss_children_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
             "peak_rss_self_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
             "command": cmd}
    (tmp / STAMP).write_text(json.dumps(stamp, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    if not src.is_dir() and not a.keep_hf:
        shutil.rmtree(hf, ignore_errors=True)
    g = stamp["graph"]
    say(f"built {out} in {stamp['seconds_total']} s ({stamp['bytes'] / 1e6:.0f} MB; MatMulNBits {g['matmulnbits']}, "
        f"lm_head {g.get('lm_head', 'MatMul fp32')}, embedding {g.get('embedding')}; peak RSS builder "
        f"{stamp['peak_rss_children_mb']} MB, de-quantize {stamp['peak_rss_self_mb']} MB)")
    return out


def cmd_build(a) -> None:
    if a.precision != "fp32" and a.lm_head is None:
        a.lm_head = "int8"
    print(build(a))


# ---------------------------------------------------------------- pair


def cmd_pair(a) -> None:
    tdir, ddir = Path(a.target).resolve(), Path(a.draft).resolve()
    tcfg = json.loads((tdir / "genai_config.json").read_text())
    dcfg = json.loads((ddir / "genai_config.json").read_text())
    tm, dm = tcfg["model"], dcfg["model"]
    if tm["vocab_size"] != dm["vocab_size"]:
        die(f"target vocab {tm['vocab_size']} != draft vocab {dm['vocab_size']}: no draft-model speculation")
    name = f"{tdir.parent.name}.{tdir.name}+{ddir.parent.name}.{ddir.name}"
    out = ROOT / "pairs" / name
    out.mkdir(parents=True, exist_ok=True)
    for link, dst in (("target", tdir), ("draft", ddir)):
        p = out / link
        if p.is_symlink() or p.exists():
            p.unlink()
        p.symlink_to(dst, target_is_directory=True)
    cfg = json.loads(json.dumps(tcfg))
    cfg["model"]["decoder"]["filename"] = "target/" + tm["decoder"]["filename"]
    draft = json.loads(json.dumps(dm["decoder"]))
    draft["filename"] = "draft/" + dm["decoder"]["filename"]
    cfg["model"]["draft"] = draft
    cfg["speculative"] = {"max_draft_tokens": a.k}
    (out / "genai_config.json").write_text(json.dumps(cfg, indent=4))
    for f in tdir.iterdir():  # tokenizer and template files: og.Tokenizer reads them from the model folder
        if (f.is_file() and f.suffix in (".json", ".jinja", ".txt", ".model")
                and f.name not in ("genai_config.json", STAMP)):
            shutil.copy2(f, out / f.name)
    say(f"draft-model pair {out}: decoder target/{tm['decoder']['filename']}, draft draft/{dm['decoder']['filename']}")
    print(out)


# ---------------------------------------------------------------- generate


def _load(og, model_dir: str, threads: int):
    cfg = og.Config(model_dir)
    raw = json.loads((Path(model_dir) / "genai_config.json").read_text())
    so = {"session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1}}
    overlay = {"decoder": so, **({"draft": so} if "draft" in raw["model"] else {})}
    cfg.overlay(json.dumps({"model": overlay}))
    return og.Model(cfg)


def _run_one(og, model, ids: list[int], max_new: int, eos: set[int], spec: dict | None):
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + max_new, min_length=0, num_beams=1,
                              repetition_penalty=1.0, no_repeat_ngram_size=0)
    if spec:
        params.set_speculative_options(**spec)
    gen = og.Generator(model, params)
    out: list[int] = []
    ttft = 0.0
    t0 = time.perf_counter()
    gen.append_tokens(ids)  # the prompt: one forward over all of it (prefill; both models when there is a draft)
    prefill = time.perf_counter() - t0
    while len(out) < max_new and not gen.is_done():
        gen.generate_next_token()  # plain: the first call only picks from the prompt's logits; speculative: it
        tok = int(gen.get_next_tokens()[0])  # runs the whole first round and buffers its tokens (one out per call)
        if not out and not ttft:
            ttft = time.perf_counter() - t0
        if tok in eos:
            break
        out.append(tok)
    total = time.perf_counter() - t0
    stats = None
    if spec:
        s = gen.get_speculative_stats()
        keep = ("rounds", "draft_tokens_proposed", "draft_tokens_accepted", "acceptance_rate", "draft_forward_passes",
                "target_forward_passes", "target_verify_forward_passes", "standard_fallback_steps",
                "ngram_lookup_hits", "ngram_lookup_misses", "effective_k")
        stats = {k: s[k] for k in keep if k in s}
    del gen, params
    return out, prefill, ttft, total, stats


def cmd_generate(a) -> None:
    """Job (JSON, stdin): {"threads", "max_new", "eos": [...], "prompts": [[ids], ...], "warmup": bool,
    "configs": [{"name", "model": dir, "speculative": {...} | null}, ...]}. Result (JSON, stdout):
    {"versions", "results": {name: [{"ids", "prefill_s", "ttft_s", "total_s", "spec_stats"}, ...] | {"error": str}}}.
    prefill_s: append_tokens (the prompt); ttft_s: until the first generate_next_token returned; total_s: until the
    last token (or the end-of-sequence token) came out. Runs the job through ``serve``: every prompt of a config,
    config after config."""
    import io

    import onnxruntime_genai as og

    job = json.load(sys.stdin if a.job == "-" else open(a.job))
    head = {k: job[k] for k in ("threads", "max_new", "eos", "configs")}
    head["warmup"] = job["prompts"][0] if job.get("warmup", True) else None
    names = [c["name"] for c in job["configs"]]
    lines = [json.dumps(head)] + [json.dumps({"config": n, "ids": ids}) for n in names for ids in job["prompts"]]
    out = io.StringIO()
    serve(og, io.StringIO("\n".join(lines) + "\n"), out)
    ready, *answers = (json.loads(line) for line in out.getvalue().splitlines())
    res: dict = {"versions": ready["versions"], "results": {}}
    for i, name in enumerate(names):
        rows = answers[i * len(job["prompts"]): (i + 1) * len(job["prompts"])]
        failed = [r["error"] for r in rows if "error" in r]
        res["results"][name] = {"error": failed[0]} if failed else rows
        for r in rows if not failed else []:
            n, dt = len(r["ids"]), r["total_s"] - r["prefill_s"]
            say(f"{name}: {n} tokens, prefill {r['prefill_s'] * 1e3:.0f} ms, decode (after prefill) "
                f"{(n - 1) / dt if n > 1 and dt > 0 else 0.0:.1f} tok/s")
    json.dump(res, sys.stdout)


def serve(og, inp, out) -> None:
    """One worker kept alive so that a benchmark can interleave this engine with others prompt by prompt (a shared
    VM's speed drifts by tens of percent within minutes; engines run in blocks minutes apart are not comparable).
    Line protocol, JSON per line. In: a header {"threads", "max_new", "eos", "configs": [...], "warmup": [ids]}
    (configs as for ``generate``), then requests {"config": name, "ids": [...]}. Out: {"ready": true, "versions",
    "errors": {name: str}} once every config is loaded and warmed up (models loaded once per folder: plain and n-gram
    share the target), then one result per request, {"ids", "prefill_s", "ttft_s", "total_s", "spec_stats"} or
    {"error"}. Ends at the end of its input."""
    head = json.loads(inp.readline())
    eos, max_new = set(head["eos"]), head["max_new"]
    models: dict[str, object] = {}
    configs, errors = {}, {}
    has_spec = hasattr(og.GeneratorParams, "set_speculative_options")
    for c in head["configs"]:
        name, spec = c["name"], c.get("speculative")
        if spec and not has_spec:
            errors[name] = "GeneratorParams has no set_speculative_options (no speculative decoding in this release)"
            continue
        try:
            if c["model"] not in models:
                say(f"{name}: loading {c['model']}")
                models[c["model"]] = _load(og, c["model"], head["threads"])
            if head.get("warmup"):  # unmeasured: allocations, kernels' first runs
                _run_one(og, models[c["model"]], head["warmup"], min(max_new, 16), eos, spec)
            configs[name] = (models[c["model"]], spec)
        except Exception as e:  # noqa: BLE001 - reported per config, the others still run
            errors[name] = f"{type(e).__name__}: {e}"
            say(f"{name}: failed: {e}")
    print(json.dumps({"ready": True, "versions": _versions(), "errors": errors}), file=out, flush=True)
    for line in inp:
        if not line.strip():
            continue
        req = json.loads(line)
        if req["config"] not in configs:
            res = {"error": errors.get(req["config"], f"unknown config {req['config']!r}")}
        else:
            model, spec = configs[req["config"]]
            try:
                ids, prefill, ttft, total, stats = _run_one(og, model, req["ids"], max_new, eos, spec)
                res = {"ids": ids, "prefill_s": prefill, "ttft_s": ttft, "total_s": total, "spec_stats": stats}
            except Exception as e:  # noqa: BLE001 - this prompt fails, the worker goes on
                res = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(res), file=out, flush=True)


def cmd_serve(a) -> None:
    import onnxruntime_genai as og

    serve(og, sys.stdin, sys.stdout)


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("venv", help="create or complete the peers venv")
    v.add_argument("--genai", help="onnxruntime-genai version instead of 0.18.*")
    b = sub.add_parser("build", help="build an onnxruntime-genai model folder (cached)")
    b.add_argument("source", help=f"a .gguf file, a Hugging Face folder, or one of {', '.join(KNOWN)}")
    b.add_argument("--precision", choices=("int4", "int8", "fp32"), default="int4")
    b.add_argument("--block", type=int, default=32, choices=(16, 32, 64, 128, 256))
    b.add_argument("--accuracy-level", type=int, default=4, choices=(0, 1, 2, 3, 4))
    b.add_argument("--asymmetric", dest="symmetric", action="store_false")
    b.add_argument("--lm-head", choices=("int4", "int8", "fp32"), default=None, help="default int8 (as ours)")
    b.add_argument("--genai-defaults", action="store_true",
                   help="the builder's own lm_head/embedding choices (int4, tied GatherBlockQuantized)")
    b.add_argument("--extra-option", action="append", metavar="KEY=VALUE", help="more builder --extra_options")
    b.add_argument("--threads", type=int, default=2, help="intra_op_num_threads written into genai_config.json")
    b.add_argument("--keep-hf", action="store_true", help="keep the de-quantized Hugging Face folder")
    p = sub.add_parser("pair", help="a draft-model speculation config over two built folders")
    p.add_argument("target")
    p.add_argument("draft")
    p.add_argument("--k", type=int, default=4, help="speculative.max_draft_tokens written into the config")
    g = sub.add_parser("generate", help="run a job (JSON) with onnxruntime-genai's generator loop")
    g.add_argument("job", nargs="?", default="-")
    sub.add_parser("serve", help="a worker for interleaved benchmarks: JSON lines in and out (see serve())")
    a = ap.parse_args()
    if a.cmd == "venv":
        return cmd_venv(a)
    ensure_env()
    {"build": cmd_build, "pair": cmd_pair, "generate": cmd_generate, "serve": cmd_serve}[a.cmd](a)


if __name__ == "__main__":
    main()

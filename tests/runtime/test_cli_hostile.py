"""spec-run and spec-export given bad input: a clear one-line error before any model work, nothing lost, never a
traceback. Bench prompts and output folders, prompt files, list options, --config files, a full chat context."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from specedge.runtime.bench import load_prompts
from specedge.runtime.cli import main as run_cli
from specedge.runtime.decoder import SpecDecoder
from specedge.runtime.errors import PromptError


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model fails the test: what is checked here must be checked before."""
    def load(*a, **kw):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(SpecDecoder, "load", load)


def bench(bundle: Path, *args: str):
    return CliRunner().invoke(run_cli, ["bench", str(bundle), "--k", "2", "--drafter", "prompt-lookup",
                                        "--max-new-tokens", "4", "--no-plots", *args])


def refused(r, message: str) -> None:
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert message in r.output, r.output
    assert "Traceback" not in r.output


def test_bench_checks_every_prompt_against_the_bundle_before_loading_a_model(bundles, tmp_path, no_model_load):
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "def add(a, b):"}\n' + json.dumps({"text": "word " * 400, "raw": True}) + "\n")
    refused(bench(bundles["lookup"], "--prompts", str(f), "--out", str(tmp_path / "o")),
            f"{f}:2: bundle built for S_max=256, request needs")
    f.write_text('{"text": "fine"}\n{"messages": [{"role": "wizard", "content": "abracadabra"}]}\n')
    refused(bench(bundles["lookup"], "--prompts", str(f), "--out", str(tmp_path / "o")),
            f"{f}:2: message 0: role 'wizard' is not allowed; roles: system, user, assistant, tool")
    refused(bench(bundles["lookup"], "--suite", "chat", "--max-new-tokens", "300", "--out", str(tmp_path / "o")),
            "suite chat, prompt chat-0: bundle built for S_max=256")
    assert not (tmp_path / "o").exists()


def _user_folder(tmp_path: Path) -> Path:
    d = tmp_path / "mine"
    d.mkdir()
    (d / "thesis.txt").write_text("four years of work")
    return d


@pytest.mark.parametrize("where, message", [
    ("/", "--out / is a folder that is not empty and holds no spec-run bench results (results.json)"),
    ("mine", "is a folder that is not empty and holds no spec-run bench results"),
    ("loop", "is a symbolic link that loops or points nowhere"),
    ("read-only", "cannot write there (Read-only file system)"),
])
def test_bench_refuses_an_output_folder_before_loading_a_model(bundles, tmp_path, monkeypatch, no_model_load, where,
                                                               message):
    import tempfile

    mine = _user_folder(tmp_path)
    out = {"/": Path("/"), "mine": mine, "loop": tmp_path / "loop", "read-only": tmp_path / "new"}[where]
    if where == "loop":
        out.symlink_to(tmp_path / "loop2")
        (tmp_path / "loop2").symlink_to(out)
    if where == "read-only":
        def mkstemp(*a, **kw):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(out))

        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    refused(bench(bundles["lookup"], "--suite", "chat", "--per-suite", "1", "--out", str(out)), message)
    assert sorted(p.name for p in mine.iterdir()) == ["thesis.txt"]
    assert (mine / "thesis.txt").read_text() == "four years of work"


def test_bench_saves_results_as_they_come_and_an_interrupt_keeps_them(bundles, tmp_path, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "def add(a, b):", "raw": true}\n{"text": "def sub(a, b):", "raw": true}\n')
    out = tmp_path / "o"
    real, calls = SpecDecoder.generate, []

    def generate(self, *a, **kw):  # 2 warm-ups (plain, prompt lookup), then 2 generations a prompt
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(SpecDecoder, "generate", generate)
    r = bench(bundles["lookup"], "--prompts", str(prompts), "--out", str(out))
    assert r.exit_code == 130, r.output
    assert f"interrupted: the 2 generations measured so far are in {out / 'results.json'}" in r.output
    kept = json.loads((out / "results.json").read_text())
    assert kept["complete"] is False and [x["drafter"] for x in kept["runs"]] == ["none", "prompt-lookup"]
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]  # no temporary file left
    monkeypatch.setattr(SpecDecoder, "generate", real)
    r = bench(bundles["lookup"], "--prompts", str(prompts), "--out", str(out))  # a previous bench output: reused
    assert r.exit_code == 0, r.output
    done = json.loads((out / "results.json").read_text())
    assert done["complete"] is True and len(done["runs"]) == 4 and "summary" in done
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json"]


def test_a_prompt_file_that_is_not_utf_8_names_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes('{"text": "ok"}\n{"text": "un café"}\n'.encode("latin-1"))
    with pytest.raises(PromptError, match=r"p.jsonl:2: not UTF-8 text \(byte 0xe9 at column 17\); save"):
        load_prompts(f)
    refused(CliRunner().invoke(run_cli, ["bench", "no-bundle", "--prompts", str(f)]), "p.jsonl:2: not UTF-8 text")


def test_a_prompt_file_line_ends_at_newline_only(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "one\u2028line, \u0085one prompt"}\n{"text": "two"}\n', encoding="utf-8")
    assert [p.prompt for p in load_prompts(f)] == ["one\u2028line, \u0085one prompt", "two"]


def test_a_prompt_file_with_an_unknown_role_names_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "fine"}\n\n{"messages": [{"role": "user", "content": "a"}, '
                 '{"role": "wizard", "content": "b"}]}\n')
    with pytest.raises(PromptError, match=r"p.jsonl:3: message 1: role 'wizard' is not allowed"):
        load_prompts(f)


@pytest.mark.parametrize("args, message", [
    (["--k", "2,,4"], "Invalid value for '--k': '2,,4' has an empty item; give a comma-separated list of draft "
                      "lengths 1..K"),
    (["--suite", ""], "Invalid value for '--suite': '' is empty; give a comma-separated list of built-in suites: "
                      "code, edit, chat"),
    (["--drafter", ""], "Invalid value for '--drafter': '' is empty; give a comma-separated list of drafters: model, "
                        "prompt-lookup"),
    (["--temperature", "0,,0.5"], "Invalid value for '--temperature': '0,,0.5' has an empty item"),
    (["--per-suite", "-1"], "Invalid value for '--per-suite': -1 is not in the range x>=0"),
])
def test_bench_list_options_refuse_empty_items_and_per_suite_a_negative_count(bundles, tmp_path, no_model_load, args,
                                                                              message):
    r = CliRunner().invoke(run_cli, ["bench", str(bundles["lookup"]), "--out", str(tmp_path / "o"), *args])
    refused(r, message)


def test_export_verify_widths_refuse_empty_items(tmp_path):
    from specedge.export.cli import main as export_cli

    for widths, what in ((",,", "is empty"), ("3,,5", "has an empty item")):
        r = CliRunner().invoke(export_cli, ["export", "--target", "no-such-model", "--verify-widths", widths,
                                            "--out", str(tmp_path / "o")])
        refused(r, f"Invalid value for '--verify-widths': '{widths}' {what}; give a comma-separated list of widths")
    assert not (tmp_path / "o").exists()


def _config(tmp_path: Path, name: str, data: str | bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return p


def test_config_integer_keys_refuse_values_that_are_not_integers(bundles, tmp_path, no_model_load):
    b = str(bundles["lookup"])
    f = _config(tmp_path, "mine.toml", "[bench]\nmax_new_tokens = 4.7\n")
    refused(CliRunner().invoke(run_cli, ["bench", b, "--config", str(f)]),
            f"[bench] max_new_tokens = 4.7 in {f}: max_new_tokens takes an integer")
    f = _config(tmp_path, "run.toml", "[run]\nk = true\n")
    refused(CliRunner().invoke(run_cli, ["generate", b, "hi", "--config", str(f)]),
            f"[run] k = true in {f}: k takes an integer")


def test_config_files_that_are_not_toml_say_so(bundles, tmp_path, no_model_load):
    b = str(bundles["lookup"])
    f = _config(tmp_path, "settings", "just some notes\n")  # no suffix: still the file, not a preset
    refused(CliRunner().invoke(run_cli, ["bench", b, "--config", str(f)]), f"config {f} is not valid TOML")
    f = _config(tmp_path, "latin.toml", "[bench]\n# caf\xe9\n".encode("latin-1"))
    refused(CliRunner().invoke(run_cli, ["bench", b, "--config", str(f)]),
            f"config {f} is not a TOML file: not UTF-8 text")
    refused(CliRunner().invoke(run_cli, ["bench", b, "--config", str(tmp_path)]), "is a folder, not a TOML file")
    refused(CliRunner().invoke(run_cli, ["bench", b, "--config", "no-such-preset"]),
            "config 'no-such-preset' not found: give a TOML file or one of the presets (cpu")


def test_chat_at_a_full_context_says_that_reset_starts_over(bundles, decoders):
    codec = decoders["lookup"].codec
    msg = "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2) " * 2
    n_msg = len(codec.encode_chat([{"role": "user", "content": msg}]))
    assert n_msg + 40 + 9 < 256 < 6 * n_msg  # alone it fits; six turns of it cannot
    r = CliRunner().invoke(run_cli, ["chat", str(bundles["lookup"]), "--max-new-tokens", "40"],
                           input=f"{msg}\n" * 6 + f"/reset\n{msg}\n/quit\n")
    assert r.exit_code == 0, r.output
    assert "error: the context is full: the conversation so far and this message do not fit" in r.output
    assert "/reset starts over with an empty history" in r.output
    assert re.search(r"\[\d+ tokens, ", r.output[r.output.index("(history cleared)"):])  # after /reset, it runs
    r = CliRunner().invoke(run_cli, ["chat", str(bundles["lookup"]), "--max-new-tokens", "40"],
                           input="word " * 300 + "\n/quit\n")
    assert "error: this message alone does not fit the context" in r.output and "/reset" not in r.output

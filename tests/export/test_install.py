"""Nothing lost: --overwrite replaces only our bundles, the swap survives an interrupt at every step, SIGTERM
cleans up, the private folders of killed exports (and only those) are removed or put back, and a symbolic link
given as --out is written through."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import specedge.export.bundle as bundle_mod
import specedge.export.install as inst
from specedge.export.bundle import ExportOptions, export_bundle
from specedge.runtime.errors import BundleError
from specedge.runtime.manifest import read_manifest

OPTS = ExportOptions(k=2, max_context=64, prefill_chunk=8)


def user_dir(tmp_path: Path) -> Path:
    d = tmp_path / "mine"
    (d / "sub").mkdir(parents=True)
    (d / "thesis.txt").write_text("four years of work")
    (d / "sub" / "data.csv").write_text("1,2,3")
    return d


def assert_user_dir_intact(d: Path) -> None:
    assert (d / "thesis.txt").read_text() == "four years of work"
    assert (d / "sub" / "data.csv").read_text() == "1,2,3"


def siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}"))


def test_overwrite_refuses_a_directory_that_is_not_a_bundle(tmp_path, tiny_llama):
    d = user_dir(tmp_path)
    with pytest.raises(BundleError, match="not a specedge bundle.*even with --overwrite"):
        export_bundle(tiny_llama, "prompt-lookup", d, ExportOptions(**{**OPTS.__dict__, "overwrite": True}))
    assert_user_dir_intact(d)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(BundleError, match="not a directory"):
        inst.check_destination(tmp_path / "afile", True)


@pytest.mark.parametrize("where", [".", "..", "~", "/"])
def test_never_the_current_home_or_root_directory(tmp_path, monkeypatch, where):
    monkeypatch.chdir(user_dir(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(BundleError, match="refusing to write a bundle to"):
        inst.check_destination(Path(os.path.expanduser(where)), True)
    assert_user_dir_intact(tmp_path / "mine")


def test_bundle_with_foreign_files_is_refused_and_kept(tmp_path, tiny_llama):
    out = export_bundle(tiny_llama, "prompt-lookup", tmp_path / "b", OPTS).out
    with pytest.raises(BundleError, match="already holds a bundle; pass --overwrite"):
        inst.check_destination(out, False)
    inst.check_destination(out, True)  # a plain bundle of ours may be replaced
    (out / "notes.md").write_text("mine")
    with pytest.raises(BundleError, match=r"does not account for \(notes.md\)"):
        inst.check_destination(out, True)
    assert (out / "notes.md").read_text() == "mine"


def test_empty_directory_is_filled(tmp_path, tiny_llama):
    (tmp_path / "empty").mkdir()
    out = export_bundle(tiny_llama, "prompt-lookup", tmp_path / "empty", OPTS).out
    assert out == tmp_path / "empty"
    m = read_manifest(out, verify="sha256")  # raises unless every file is there with its hash
    assert m.drafter == "prompt-lookup" and {"manifest.json", m.target.graph, m.target.weights} <= {
        p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name != "empty"]  # no workspace left beside it


def _complete_bundle_id(out: Path) -> str:
    m = read_manifest(out, verify="sha256")  # every file present with its hash
    return m.drafter


class Boom(KeyboardInterrupt):
    pass


def _calls_to_inject(monkeypatch):
    """Wrap every step an export takes after its sources are loaded; raise at the n-th call (set later)."""
    state = {"n": -1, "count": 0}

    def wrap(obj, name):
        real = getattr(obj, name)

        def f(*a, **kw):
            state["count"] += 1
            if state["count"] == state["n"]:
                raise Boom(f"interrupt at step {state['count']} ({name})")
            return real(*a, **kw)

        monkeypatch.setattr(obj, name, f)

    for obj, name in ((bundle_mod, "write_tokenizer"), (bundle_mod, "_export_model"), (bundle_mod, "file_entry"),
                      (bundle_mod, "write_manifest"), (bundle_mod, "install"), (inst.os, "replace"),
                      (inst, "_mark"), (inst, "_unmark"), (inst, "_remove_private"), (inst.shutil, "rmtree")):
        wrap(obj, name)
    return state


def test_interrupt_at_every_step_of_an_overwrite_keeps_a_complete_bundle(tmp_path, tiny_llama, monkeypatch):
    out = export_bundle(tiny_llama, "none", tmp_path / "b", OPTS).out  # the old bundle: drafter "none"
    opts = ExportOptions(**{**OPTS.__dict__, "overwrite": True})
    probe = export_bundle(tiny_llama, "none", tmp_path / "probe", opts).out
    state = _calls_to_inject(monkeypatch)
    export_bundle(tiny_llama, "prompt-lookup", probe, opts)  # count the steps of one overwriting export
    total = state["count"]
    assert total >= 8
    outcomes = set()
    for n in range(1, total + 1):
        state.update(n=n, count=0)
        try:
            export_bundle(tiny_llama, "prompt-lookup", out, opts)
        except Boom:
            pass
        got = _complete_bundle_id(out)  # old ("none") or new ("prompt-lookup"), never missing or partial
        outcomes.add(got)
        state.update(n=-1)
        if got == "prompt-lookup":  # put the old one back for the next step
            export_bundle(tiny_llama, "none", out, opts)
        assert not [s for s in siblings(out) if ".tmp-" in s], f"temp dir left after an interrupt at step {n}"
    assert outcomes == {"none", "prompt-lookup"}


SLOW_EXPORT = """
import sys, time
import specedge.export.bundle as b
real = b.file_entry
def slow(p, *a, **kw):
    print("hashing", flush=True); time.sleep(30); return real(p, *a, **kw)
b.file_entry = slow
b.export_bundle(sys.argv[1], "prompt-lookup", sys.argv[2],
                b.ExportOptions(k=2, max_context=64, prefill_chunk=8, overwrite=True))
"""


def test_sigterm_during_export_cleans_up_and_keeps_the_old_bundle(tmp_path, tiny_llama):
    out = export_bundle(tiny_llama, "none", tmp_path / "b", OPTS).out
    p = subprocess.Popen([sys.executable, "-c", SLOW_EXPORT, str(tiny_llama), str(out)], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "hashing"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) != 0
    assert siblings(out) == []
    assert _complete_bundle_id(out) == "none"


def _dead_pid() -> int:
    pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                             text=True).stdout)
    time.sleep(0.1)
    return pid


def _killed(script: str, *args: str, wait_for: str | None = None) -> None:
    """Run an export in a child process that SIGKILLs itself (or is SIGKILLed once it prints ``wait_for``)."""
    p = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    if wait_for is not None:
        assert p.stdout.readline().strip() == wait_for
        p.kill()
    assert p.wait(timeout=60) == -signal.SIGKILL


def test_a_workspace_left_by_a_killed_export_is_removed_by_the_next(tmp_path, tiny_llama):
    out = export_bundle(tiny_llama, "none", tmp_path / "b", OPTS).out
    _killed(SLOW_EXPORT, str(tiny_llama), str(out), wait_for="hashing")
    left = siblings(out)
    assert len(left) == 1 and ".tmp-" in left[0] and (tmp_path / left[0] / inst.MARKER).is_file()
    assert _complete_bundle_id(out) == "none"
    live = tmp_path / f".b.tmp-{os.getpid()}-live"  # a running export's (this process's): kept
    live.mkdir()
    inst._mark(live)
    (tmp_path / ".other.tmp-1-x").mkdir()  # another bundle's: not ours to judge here
    export_bundle(tiny_llama, "prompt-lookup", out, ExportOptions(**{**OPTS.__dict__, "overwrite": True}))
    assert siblings(out) == [live.name]
    assert (tmp_path / ".other.tmp-1-x").is_dir() and _complete_bundle_id(out) == "prompt-lookup"


KILLED_BETWEEN_RENAMES = """
import os, signal, sys
import specedge.export.bundle as b
real = os.replace
def replace(src, dst):
    if os.path.abspath(dst) == os.path.abspath(sys.argv[2]) and ".tmp-" in os.path.basename(src):
        os.kill(os.getpid(), signal.SIGKILL)  # the old bundle is aside, the new one not yet in place
    return real(src, dst)
os.replace = replace
b.export_bundle(sys.argv[1], "prompt-lookup", sys.argv[2],
                b.ExportOptions(k=2, max_context=64, prefill_chunk=8, overwrite=True))
"""


def test_a_bundle_moved_aside_by_a_killed_export_is_put_back_by_the_next(tmp_path, tiny_llama):
    out = export_bundle(tiny_llama, "none", tmp_path / "b", OPTS).out
    _killed(KILLED_BETWEEN_RENAMES, str(tiny_llama), str(out))
    assert not out.exists() and any(".old-" in s for s in siblings(out))  # the old bundle is whole, aside
    with pytest.raises(BundleError, match="already holds a bundle; pass --overwrite"):
        inst.check_destination(out, False)  # it is back in place, and replaced only with --overwrite
    assert _complete_bundle_id(out) == "none"
    export_bundle(tiny_llama, "prompt-lookup", out, ExportOptions(**{**OPTS.__dict__, "overwrite": True}))
    assert _complete_bundle_id(out) == "prompt-lookup" and siblings(out) == []


def test_folders_of_the_user_named_like_private_siblings_are_never_removed(tmp_path, tiny_llama):
    dead = _dead_pid()
    mine = [tmp_path / n for n in (f".b.tmp-{dead}-x1", f".b.old-{dead}", f".b.old-{dead}-cafe", f".b.tmp-{dead}-m",
                                   "elsewhere")]
    for d in mine:
        d.mkdir()
        (d / "thesis.txt").write_text("four years of work")
    (mine[3] / inst.MARKER).write_text(json.dumps({"magic": "something else", "pid": dead}))
    (mine[4] / inst.MARKER).write_text(json.dumps({"magic": inst._MAGIC, "pid": dead}))
    (tmp_path / f".b.old-{dead}-link").symlink_to(mine[4])  # a link is never followed, whatever it points to
    copy = export_bundle(tiny_llama, "none", tmp_path / f".b.old-{dead}-copy", OPTS).out  # a bundle, no marker
    export_bundle(tiny_llama, "prompt-lookup", tmp_path / "b", OPTS)  # b is new: nothing is put back in its place
    export_bundle(tiny_llama, "prompt-lookup", tmp_path / "b", ExportOptions(**{**OPTS.__dict__, "overwrite": True}))
    assert _complete_bundle_id(tmp_path / "b") == "prompt-lookup"
    for d in mine:
        assert (d / "thesis.txt").read_text() == "four years of work"
    assert _complete_bundle_id(copy) == "none" and (tmp_path / f".b.old-{dead}-link").is_symlink()


def test_overwrite_through_a_symbolic_link_writes_where_it_points_and_keeps_the_link(tmp_path, tiny_llama):
    v1 = export_bundle(tiny_llama, "none", tmp_path / "v1", OPTS).out
    link = tmp_path / "current"
    link.symlink_to("v1")
    with pytest.raises(BundleError, match="already holds a bundle; pass --overwrite"):
        export_bundle(tiny_llama, "prompt-lookup", link, OPTS)
    rep = export_bundle(tiny_llama, "prompt-lookup", link, ExportOptions(**{**OPTS.__dict__, "overwrite": True}))
    assert rep.out == link and link.is_symlink() and os.readlink(link) == "v1"
    assert _complete_bundle_id(v1) == "prompt-lookup"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "v1"]  # no private sibling left behind
    (tmp_path / "empty").mkdir()
    (tmp_path / "to-empty").symlink_to(tmp_path / "empty")
    export_bundle(tiny_llama, "none", tmp_path / "to-empty", OPTS)
    assert (tmp_path / "to-empty").is_symlink() and _complete_bundle_id(tmp_path / "empty") == "none"


def test_a_symbolic_link_loop_or_a_dangling_link_is_refused(tmp_path, tiny_llama):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(BundleError, match="is a symbolic link that loops"):
        export_bundle(tiny_llama, "none", tmp_path / "a", ExportOptions(**{**OPTS.__dict__, "overwrite": True}))
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(BundleError, match="dangling symbolic link"):
        export_bundle(tiny_llama, "none", tmp_path / "gone", OPTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "gone"]


def test_k_is_bounded():
    with pytest.raises(BundleError, match=r"--k must be in 1..16, got 100"):
        ExportOptions(k=100)

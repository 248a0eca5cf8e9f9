"""Putting a finished bundle in place without ever losing data.

* :func:`check_destination` runs before any work: ``--out`` may be a new path, an empty directory, or — with
  ``overwrite`` — a directory that is recognisably one of our bundles (a ``manifest.json`` of our schema, and
  nothing in it that the manifest does not account for). Anything else is refused, and so are ``/``, the home
  directory and the current directory or any of its parents, whatever the flags say.
* ``--out`` may be a symbolic link to a directory: the bundle is written into the link's target
  (:func:`real_destination`), next to which the private siblings are made, and the link is kept. A dangling link
  or a loop is refused.
* :func:`install` swaps the new bundle in crash-safely: the old one is renamed aside, the new one renamed into
  place, then the old one deleted. SIGINT/SIGTERM are held off during the two renames, and a failure between
  them puts the old one back. At every instant the destination holds the old bundle or the new one, complete,
  except after a SIGKILL or power loss between the two renames: then the old bundle is whole in its aside
  folder, and the next export into the same destination (:func:`check_destination`) renames it back first.
* :func:`workspace` is the private temporary sibling an export writes into; it is removed on any exception,
  including SIGTERM (turned into :class:`Terminated` for the duration), and stale ones left by a killed
  process (SIGKILL, power loss) are removed by the next export into the same folder.
* Every private sibling (``.<name>.tmp-<pid>-<rand>``, ``.<name>.old-<pid>-<rand>``) holds a marker file
  (:data:`MARKER`) saying which process made it. Only siblings holding that marker, made by a process that no
  longer runs, are ever removed or restored: a folder of the user's that merely has such a name is left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from specedge.runtime.errors import BundleError
from specedge.runtime.manifest import MANIFEST_NAME, SCHEMA

_TMP, _OLD = ".tmp-", ".old-"  # infixes of our private siblings: .<name>.tmp-<pid>-<rand>, .<name>.old-<pid>-<rand>
# The marker file in each private sibling: {"magic": _MAGIC, "pid": <the exporting process>}. An installed bundle
# may keep one for a moment (it moves into place with the workspace and is deleted right after).
MARKER = ".specedge-export"
_MAGIC = "specedge export: a private folder of process `pid`, removed once that process no longer runs"
# Generated entries a bundle may hold besides the files its manifest lists (TensorRT engines and caches).
_GENERATED = {MANIFEST_NAME, "trt", "trt-ep-cache", MARKER}


class Terminated(BaseException):
    """SIGTERM arrived during an export (raised so that cleanup runs, like KeyboardInterrupt)."""


def _protected(path: Path) -> bool:
    p = path.resolve()
    cwd = Path.cwd().resolve()
    return p == Path(p.anchor) or p == Path.home().resolve() or p == cwd or p in cwd.parents


def _bundle_entries(path: Path) -> set[str] | None:
    """The top-level names a bundle of ours at ``path`` accounts for, or None if it is not one."""
    try:
        m = json.loads((path / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or not str(m.get("schema", "")).startswith(SCHEMA.rsplit("/", 1)[0] + "/"):
        return None
    names = set(_GENERATED)
    names.update(str(f).split("/", 1)[0] for f in (m.get("files") or {}))
    for es in (m.get("engines") or {}).values():
        if isinstance(es, dict):
            names.update(str(f).split("/", 1)[0] for f in (es.get("files") or {}))
    return names


def real_destination(out: str | Path) -> Path:
    """Where a bundle for ``--out`` goes: ``out`` itself, or, where it is a symbolic link, the link's target (a
    chain of links followed to its end), so that the link is kept and the bundle is written where it points."""
    out = Path(out)
    if not out.is_symlink():
        return out
    try:
        real = out.resolve(strict=False)
    except (RuntimeError, OSError) as e:  # a link loop: RuntimeError up to Python 3.12, OSError(ELOOP) after
        raise BundleError(f"--out {out} is a symbolic link that loops ({e}); remove it or choose another --out") \
            from None
    if not real.exists():
        raise BundleError(f"{out} is a dangling symbolic link (to {real}); remove it or choose another --out")
    return real


def check_destination(out: Path, overwrite: bool) -> None:
    """Refuse, before any work is done, a destination that an export must not replace. ``out`` is a real path
    (:func:`real_destination`). A bundle that a killed export had moved aside is renamed back first."""
    out = Path(out)
    restore_interrupted(out)
    if _protected(out):
        raise BundleError(f"refusing to write a bundle to {out} (resolves to {out.resolve()}: the filesystem root, "
                          f"the home directory or the current directory/one of its parents); choose a new folder, "
                          f"e.g. --out engines/<name>")
    if not out.exists():
        if out.is_symlink():
            raise BundleError(f"{out} is a dangling symbolic link; remove it or choose another --out")
        return
    if not out.is_dir():
        raise BundleError(f"{out} exists and is not a directory; choose another --out")
    if not any(out.iterdir()):
        return
    known = _bundle_entries(out)
    if known is None:
        raise BundleError(f"{out} is a non-empty directory that is not a specedge bundle (no {MANIFEST_NAME} of "
                          f"schema {SCHEMA}); refusing to replace it, even with --overwrite. Choose another --out")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in known)
    if foreign:
        raise BundleError(f"{out} is a specedge bundle but also holds {len(foreign)} entries the bundle does not "
                          f"account for ({', '.join(foreign[:5])}); refusing to replace it. Move them out first")
    if not overwrite:
        raise BundleError(f"{out} already holds a bundle; pass --overwrite to replace it")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mark(folder: Path) -> None:
    """Write the marker that makes ``folder`` recognisably this process's private sibling."""
    (folder / MARKER).write_text(json.dumps({"magic": _MAGIC, "pid": os.getpid()}) + "\n")


def _unmark(folder: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (folder / MARKER).unlink()


def _marked_by(folder: Path) -> int | None:
    """The pid in ``folder``'s marker, or None where it holds no marker of ours (or is not a plain folder)."""
    f = folder / MARKER
    if folder.is_symlink() or not folder.is_dir() or f.is_symlink() or not f.is_file():
        return None
    try:
        m = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("magic") != _MAGIC or type(m.get("pid")) is not int:
        return None
    return m["pid"]


def _stale_siblings(out: Path, infix: str) -> list[Path]:
    """The private siblings of ``out`` with this infix whose marker names a process that no longer runs."""
    prefix = f".{out.name}{infix}"
    if not out.parent.is_dir():
        return []
    found = []
    for p in out.parent.iterdir():
        if not p.name.startswith(prefix):
            continue
        pid = p.name[len(prefix):].split("-")[0]
        if pid.isdigit() and _marked_by(p) == int(pid) and not _alive(int(pid)):
            found.append(p)
    return found


def restore_interrupted(out: Path) -> Path | None:
    """Where ``out`` is missing and an export killed between its two renames left the old bundle aside, rename
    that bundle back to ``out`` (the newest, if there are several). Returns the folder restored, if any."""
    if out.exists() or out.is_symlink():
        return None
    aside = [p for p in _stale_siblings(out, _OLD) if (p / MANIFEST_NAME).is_file()]
    if not aside:
        return None
    newest = max(aside, key=lambda p: p.stat().st_mtime)
    os.replace(newest, out)
    _unmark(out)
    return newest


def _remove_private(folder: Path) -> None:
    """Delete a private sibling: its manifest first (a half-deleted bundle is never restored), its marker last
    (a half-deleted folder is still recognisably ours, and the next export finishes the job)."""
    with contextlib.suppress(OSError):
        entries = sorted(folder.iterdir(), key=lambda p: (p.name != MANIFEST_NAME, p.name == MARKER))
        for p in entries:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
        folder.rmdir()


def remove_stale(out: Path) -> list[Path]:
    """Remove the private siblings of ``out`` left by exports whose process no longer runs: only folders holding
    an export's marker (:data:`MARKER`) are candidates."""
    removed = []
    for p in _stale_siblings(out, _TMP) + _stale_siblings(out, _OLD):
        _remove_private(p)
        removed.append(p)
    return removed


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` (main thread only; elsewhere it stays the default)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):  # noqa: ANN001
        raise Terminated(f"terminated by signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def workspace(out: Path) -> Iterator[Path]:
    """A private temporary sibling of ``out`` to write the bundle into, removed on any failure or signal."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    with _sigterm_raises():
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}{_TMP}{os.getpid()}-", dir=out.parent))
        try:
            _mark(tmp)
            yield tmp
        except BaseException:
            _remove_private(tmp)
            raise


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Delay SIGINT/SIGTERM until the block ends (they are delivered right after)."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    can = threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask")
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs) if can else None
    try:
        yield
    finally:
        if can:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _aside_path(out: Path) -> Path:
    while True:
        p = out.parent / f".{out.name}{_OLD}{os.getpid()}-{secrets.token_hex(4)}"
        if not (p.exists() or p.is_symlink()):
            return p


def install(tmp: Path, out: Path) -> None:
    """Move the finished bundle ``tmp`` (a :func:`workspace`) to ``out`` (a real path: :func:`real_destination`);
    an existing bundle there is replaced only once the new one is in place (see the module docstring)."""
    aside = None
    with _signals_held():
        if out.exists():
            _mark(out)  # marked before it is moved: an aside folder is never without its marker
            aside = _aside_path(out)
            try:
                os.replace(out, aside)
            except BaseException:
                _unmark(out)
                raise
        try:
            os.replace(tmp, out)
        except BaseException:
            if aside is not None and not out.exists():
                os.replace(aside, out)
                _unmark(out)
            raise
    _unmark(out)  # the workspace's, moved into place with the bundle
    if aside is not None:
        _remove_private(aside)

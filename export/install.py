"""Putting a finished bundle in place without ever losing data.

* :func:`check_destination` runs before any work: ``--out`` may be a new path, an empty directory, or — with
  ``overwrite`` — a directory that is recognisably one of our bundles (a ``manifest.json`` of our schema, and
  nothing in it that the manifest does not account for). Anything else is refused, and so are ``/``, the home
  directory and the current directory or any of its parents, whatever the flags say.
* :func:`install` swaps the new bundle in crash-safely: the old one is renamed aside, the new one renamed into
  place, then the old one deleted. SIGINT/SIGTERM are held off during the two renames, and a failure between
  them puts the old one back. At every instant the destination holds the old bundle or the new one, complete.
* :func:`workspace` is the private temporary sibling an export writes into; it is removed on any exception,
  including SIGTERM (turned into :class:`Terminated` for the duration), and stale ones left by a killed
  process (SIGKILL, power loss) are removed by the next export into the same folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from specedge.runtime.errors import BundleError
from specedge.runtime.manifest import MANIFEST_NAME, SCHEMA

_TMP, _OLD = ".tmp-", ".old-"  # infixes of our private siblings: .<name>.tmp-<pid>-<rand>, .<name>.old-<pid>
# Generated entries a bundle may hold besides the files its manifest lists (TensorRT engines and caches).
_GENERATED = {MANIFEST_NAME, "trt", "trt-ep-cache"}


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


def check_destination(out: Path, overwrite: bool) -> None:
    """Refuse, before any work is done, a destination that an export must not replace."""
    out = Path(out)
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


def remove_stale(out: Path) -> list[Path]:
    """Remove the private siblings of ``out`` left by exports whose process no longer runs."""
    removed = []
    prefix = f".{out.name}"
    if not out.parent.is_dir():
        return removed
    for p in out.parent.iterdir():
        rest = p.name[len(prefix):]
        if not (p.name.startswith(prefix) and p.is_dir() and (rest.startswith(_TMP) or rest.startswith(_OLD))):
            continue
        pid = rest.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
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
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
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


def install(tmp: Path, out: Path) -> None:
    """Move the finished bundle ``tmp`` to ``out``; an existing bundle there is replaced only once the new one
    is in place (see the module docstring)."""
    aside = None
    with _signals_held():
        if out.exists():
            aside = out.parent / f".{out.name}{_OLD}{os.getpid()}"
            if aside.exists():
                shutil.rmtree(aside)
            os.replace(out, aside)
        try:
            os.replace(tmp, out)
        except BaseException:
            if aside is not None and not out.exists():
                os.replace(aside, out)
            raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)

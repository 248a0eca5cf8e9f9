"""A bundle's files on disk: their hashes (whole and sampled), checking them against the manifest, and noticing
when they change under a loaded decoder."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from .errors import BundleError

SAMPLE_BLOCK = 4096  # bytes of each block the sampled hash reads
SAMPLE_MIN_BLOCKS = 64  # a file of up to 64 blocks is hashed whole
SAMPLE_MAX_STRIDE = 1 << 20  # a larger one: a block every MiB at most (1 GiB: 1024 blocks, 4 MiB read)


def sample_stride(size: int) -> int:
    """Bytes between the sampled blocks of a file of ``size`` bytes: every region longer than stride + block holds a
    whole block, so zeroing or overwriting one is caught without reading the file."""
    return max(SAMPLE_BLOCK, min(SAMPLE_MAX_STRIDE, size // SAMPLE_MIN_BLOCKS // SAMPLE_BLOCK * SAMPLE_BLOCK))


def sampled_sha256(path: Path, stride: int) -> str:
    """The sha256 of a file's blocks at 0, stride, 2*stride, ... and of its last block, with the file's size."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        for at in [*range(0, size, stride), max(0, size - SAMPLE_BLOCK)]:
            f.seek(at)
            h.update(f.read(SAMPLE_BLOCK))
    return h.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """A bundle file's manifest entry: its sha256 and size, and the sampled hash ``verify="size"`` checks."""
    size = path.stat().st_size
    stride = sample_stride(size)
    return {"sha256": sha256_file(path), "bytes": size,
            "sample": {"stride": stride, "sha256": sampled_sha256(path, stride)}}


def hex64(v: Any) -> bool:
    """A sha256 as the manifest writes it: 64 lowercase hex digits."""
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


class FileWatch:
    """The identity of a bundle's files (device, inode, size, modification time) when a decoder read them. A file
    replaced, rewritten or truncated afterwards is found by :meth:`check` (a few ``stat`` calls) before a request
    runs: the decoder refuses it with an error that says to load the bundle again, rather than answer from weights
    that no longer match the files, or, mapped, crash."""

    def __init__(self, bundle_dir: Path, names: Any):
        self.bundle_dir = Path(bundle_dir)
        self.stamps = {name: self._stamp(name) for name in names}

    def _stamp(self, name: str) -> tuple[int, ...] | None:
        try:
            st = os.stat(self.bundle_dir / name)
        except OSError:
            return None
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def changed(self) -> list[str]:
        return [name for name, stamp in self.stamps.items() if self._stamp(name) != stamp]

    def check(self) -> None:
        changed = self.changed()
        if changed:
            raise BundleError(f"{', '.join(changed)} in {self.bundle_dir} changed on disk after this decoder loaded "
                              f"the bundle (replaced, rewritten or removed): load the bundle again (a server: "
                              f"restart it) to serve what is there now")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def verify_files(bundle_dir: Path, manifest: Any, verify: str, skip: frozenset[str] = frozenset()) -> None:
    """Every file a :class:`.manifest.Manifest` lists (but ``skip``) is present with its size and sampled hash
    ("size"), or its sha256 ("sha256")."""
    if verify == "none":
        return
    for name, meta in manifest.files.items():
        if name in skip:
            continue
        f = bundle_dir / name
        if not f.is_file():
            raise BundleError(f"bundle {bundle_dir} is missing {name} (listed in the manifest)")
        size = f.stat().st_size
        if size != meta["bytes"]:
            raise BundleError(
                f"{name} in {bundle_dir} has {size} bytes, the manifest says {meta['bytes']}: the bundle is corrupt"
            )
        if verify == "sha256" and sha256_file(f) != meta["sha256"]:
            raise BundleError(
                f"{name} in {bundle_dir} fails its sha256 check (manifest {meta['sha256'][:12]}…): "
                "the bundle is corrupt; re-export it"
            )
        sample = meta.get("sample")
        if verify == "size" and sample is not None and sampled_sha256(f, sample["stride"]) != sample["sha256"]:
            raise BundleError(
                f"{name} in {bundle_dir} fails its sampled hash check (blocks every {sample['stride']} bytes): "
                f"it was overwritten or zeroed in part since export; the bundle is corrupt, re-export it "
                f"(`spec-export info {bundle_dir}` checks every file's sha256)"
            )

"""What a backend's libraries must be for specedge: checked where a runner opens and by `spec-export doctor`."""

from __future__ import annotations

MIN_TENSORRT = (10, 3)  # STRONGLY_TYPED networks, USER_MANAGED scratch, INT64 tensors; JetPack 6.1/6.2 ship 10.3


def tensorrt_version_problem(version: str) -> str | None:
    """Why this TensorRT cannot build or run specedge engines (None: it can)."""
    try:
        have = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return f"TensorRT version {version!r} is not recognisable"
    if have < MIN_TENSORRT:
        return (f"TensorRT {version} is too old: specedge needs TensorRT >= {MIN_TENSORRT[0]}.{MIN_TENSORRT[1]} "
                f"(strongly typed networks, user-managed scratch, INT64 tensors) - JetPack 6.1 or newer on a Jetson, "
                f"pip install 'tensorrt>=10.3' elsewhere")
    return None

"""The tools under tools/ (and tools/dev/, tools/gpu/) are scripts, not a package: tests load one by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parent.parent / "tools"
FOLDERS = (TOOLS, TOOLS / "dev", TOOLS / "gpu")


def tool_path(name: str) -> Path:
    """tools/<name>, tools/dev/<name> or tools/gpu/<name>, whichever holds it."""
    for d in FOLDERS:
        if (d / name).exists():
            return d / name
    raise FileNotFoundError(f"no tool {name} in {', '.join(map(str, FOLDERS))}")


def load_tool(name: str) -> ModuleType:
    """tools/[dev/|gpu/]<name>.py as a module (registered under its name: a dataclass in it looks its module up)."""
    spec = importlib.util.spec_from_file_location(name, tool_path(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod

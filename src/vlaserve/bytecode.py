"""Python bytecode for the modules a start imports.

A server imports ~1,500 modules, most of them torch's. Python runs each from its cached bytecode
(`__pycache__/*.pyc`) when there is one and compiles it from source otherwise. pip writes the bytecode
at install; uv does not unless asked (`--compile-bytecode`), and with PYTHONDONTWRITEBYTECODE=1, common
in container images, Python never writes what it compiled: then every start compiles the same modules
again: the server's imports took nearly twice the CPU time, and with an empty compile cache each compile
worker, a process that imports torch, paid it too, seconds on the way to the first action.
`vlaserve warmup` writes it; `vlaserve serve` says when it is missing.
"""

from __future__ import annotations

import importlib.util
import py_compile
import sys
from pathlib import Path

# `vlaserve serve` warns from this many modules without bytecode on; fewer cost ~0.1 s a start
# (vlaserve's own ~80 modules, installed editable under PYTHONDONTWRITEBYTECODE=1).
WARN_AT_MODULES = 200


def imported_without_bytecode() -> tuple[list[Path], int]:
    """The source files of the modules imported in this process that have no bytecode cached next to
    them (in their `__pycache__`), and how many source modules were imported in all."""
    sources = set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        # (torch._classes and torch._ops name a bare "_classes.py": no file of their own)
        if path and path.endswith(".py") and Path(path).is_absolute():
            sources.add(Path(path))
    missing = sorted(p for p in sources if not Path(importlib.util.cache_from_source(str(p))).exists())
    return missing, len(sources)


def write_bytecode(sources: list[Path]) -> tuple[int, list[str]]:
    """Compiles each source into its `__pycache__` (as pip does at install) -> (written, failures: one
    line each, e.g. a read-only site-packages)."""
    written, failures = 0, []
    for source in sources:
        try:
            py_compile.compile(str(source), doraise=True)
            written += 1
        except (OSError, py_compile.PyCompileError) as e:
            failures.append(f"{source}: {e}")
    return written, failures

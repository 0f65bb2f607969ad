"""Python bytecode for the modules a start imports (vlaserve.bytecode): found missing, written as pip
writes it, and what `vlaserve serve` says when most of it is missing."""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path

import vlaserve.cli
from vlaserve.bytecode import WARN_AT_MODULES, imported_without_bytecode, write_bytecode


def _package(tmp_path, monkeypatch, name: str) -> list[Path]:
    """A two-module package imported with PYTHONDONTWRITEBYTECODE's effect: no bytecode written."""
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("VALUE = 1\n")
    (root / "part.py").write_text("from . import VALUE\nDOUBLE = 2 * VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    importlib.import_module(f"{name}.part")
    return [root / "__init__.py", root / "part.py"]


def test_modules_imported_without_bytecode_are_found_and_written_as_pip_would(tmp_path, monkeypatch):
    sources = _package(tmp_path, monkeypatch, "bytecode_probe_pkg")
    missing, imported = imported_without_bytecode()
    assert set(sources) <= set(missing) and imported >= len(missing)
    assert write_bytecode(sources) == (2, [])
    for source in sources:
        cached = Path(importlib.util.cache_from_source(str(source)))
        assert cached.exists() and cached.parent.name == "__pycache__"
    assert not set(sources) & set(imported_without_bytecode()[0])
    # The next import of the module runs from that bytecode: the loader reads the file written.
    spec = importlib.util.find_spec("bytecode_probe_pkg.part")
    assert spec.cached == importlib.util.cache_from_source(str(sources[1]))


def test_a_module_that_does_not_compile_is_reported_and_the_others_written(tmp_path):
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text("X = 1\n")
    bad.write_text("def broken(:\n")
    written, failures = write_bytecode([bad, good])
    assert written == 1 and len(failures) == 1 and failures[0].startswith(f"{bad}: ")
    assert Path(importlib.util.cache_from_source(str(good))).exists()


def _startup_log(monkeypatch, caplog, golden_policy, missing: int, imported: int = 1500) -> str:
    monkeypatch.setattr(vlaserve.cli, "imported_without_bytecode", lambda: ([Path(f"m{i}.py") for i in range(missing)],
                                                                            imported))
    with caplog.at_level(logging.INFO, logger="vlaserve"):
        vlaserve.cli.log_startup(golden_policy, {"host": "127.0.0.1", "port": 8000, "api_key": None})
    return caplog.text


def test_serve_warns_when_most_of_its_imports_compile_from_source_at_every_start(golden_policy, monkeypatch, caplog):
    # sys.flags is read-only: the cause the message names is the one this process has.
    text = _startup_log(monkeypatch, caplog, golden_policy, missing=900)
    assert "900 of the 1500 Python modules this start imported have no bytecode" in text
    assert "`vlaserve warmup` writes it" in text
    cause = "PYTHONDONTWRITEBYTECODE is set" if sys.flags.dont_write_bytecode else "not writable"
    assert cause in text


def test_serve_says_nothing_of_a_few_modules_without_bytecode(golden_policy, monkeypatch, caplog):
    # vlaserve's own ~80 modules, editable and PYTHONDONTWRITEBYTECODE=1: ~0.1 s a start, not worth a warning.
    text = _startup_log(monkeypatch, caplog, golden_policy, missing=WARN_AT_MODULES - 1)
    assert "no bytecode" not in text and "serving at http://127.0.0.1:8000" in text

"""The package's import graph has no cycle, counting imports inside functions too.

An import inside a function is still an import: a cycle closed by one only moves the failure to the
first call. The graph is built from the source (no module is imported), with an edge for every
`import vlaserve...` / `from . import ...` anywhere in a module, at any depth. A package's
`__init__` is a node of its own; importing a submodule does not count as importing its package's
`__init__` (that one runs first but imports nothing back here).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vlaserve

PACKAGE = "vlaserve"


def package_root() -> Path:
    # The source tree the tests run against (PYTHONPATH decides which one).
    return Path(vlaserve.__file__).parent


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package (packages by __init__)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            # `from a import b` imports a, and a.b when b is a submodule rather than a name in a.
            targets = [source, *(f"{source}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            # `import a.b.c` names a module; the longest known prefix is what the statement reaches.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE) and target != name:
                found.add(target)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a, b, ..., a) through each strongly connected set of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first back to it)."""
    start = min(component)
    parents = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_the_package_has_no_import_cycle():
    cycles = find_cycles(import_graph(package_root()))
    assert not cycles, "import cycles (function-local imports count):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


# What a module may not import (itself or below it), by the layers of the README's Layout: the
# data types know only the errors; config is dataclasses; checkpoint/ reads files, builds no model;
# nothing below the policy knows the policy, the batcher above it, or the server and command line.
ABOVE_THE_POLICY = ("vlaserve.policy", "vlaserve.batcher", "vlaserve.server", "vlaserve.fleet", "vlaserve.cli",
                    "vlaserve.options", "vlaserve.info", "vlaserve.golden")
# Start-up drives the engine and is dropped: the runtime never knows it. The runtime reads host batches
# (vlaserve.types) and may use processing's pure image math, nothing else of the host side; processing
# is host-only and knows neither the model nor the families.
RUNTIME_MAY_USE_OF_PROCESSING = ("vlaserve.processing.images",)
RULES = {
    "vlaserve.types": {"allowed": ("vlaserve.errors",)},
    "vlaserve.config": {"allowed": ("vlaserve.errors", "vlaserve.checkpoint.files")},
    "vlaserve.checkpoint": {"forbidden": ("vlaserve.model", "vlaserve.family", "vlaserve.processing",
                                          "vlaserve.runtime", "vlaserve.demo", *ABOVE_THE_POLICY)},
    **{layer: {"forbidden": ABOVE_THE_POLICY} for layer in (
        "vlaserve.errors", "vlaserve.model", "vlaserve.processing", "vlaserve.runtime", "vlaserve.family",
        "vlaserve.demo")},
    "vlaserve.policy": {"forbidden": ABOVE_THE_POLICY[1:]},
    "vlaserve.runtime": {"forbidden": (*ABOVE_THE_POLICY, "vlaserve.startup", "vlaserve.processing"),
                         "except": RUNTIME_MAY_USE_OF_PROCESSING},
    "vlaserve.runtime.fast": {"forbidden": ("vlaserve.runtime",)},  # the fast model and its kernels, below the runners
    "vlaserve.startup": {"forbidden": ABOVE_THE_POLICY},
    "vlaserve.processing": {"forbidden": (*ABOVE_THE_POLICY, "vlaserve.model", "vlaserve.family", "vlaserve.runtime",
                                          "vlaserve.startup")},
    "vlaserve.fleet": {"forbidden": ("vlaserve.cli",)},
}


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, imports in sorted(graph.items()):
        for layer, rule in RULES.items():
            if not _within(module, layer):
                continue
            for target in sorted(imports):
                if _within(target, layer):
                    continue
                if "allowed" in rule and not any(_within(target, a) for a in rule["allowed"]):
                    found.append(f"{module} imports {target} (it may import only {', '.join(rule['allowed'])})")
                if any(_within(target, f) for f in rule.get("forbidden", ())) and not any(
                        _within(target, e) for e in rule.get("except", ())):
                    found.append(f"{module} imports {target}, a layer above it")
    return found


def test_each_layer_imports_only_below_it():
    violations = layering_violations(import_graph(package_root()))
    assert not violations, "\n".join(violations)


# ---- the checker itself can fail ---------------------------------------------------------------
def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / PACKAGE


def test_a_cycle_closed_inside_a_function_is_found(tmp_path):
    root = write(tmp_path, {
        "__init__.py": "",
        "config.py": "def load():\n    from .family import family_named\n",
        "family.py": "from .checkpoint.weights import LAYOUT\n",
        "checkpoint/__init__.py": "",
        "checkpoint/weights.py": "import json\nfrom ..config import ModelConfig\n",
    })
    cycles = find_cycles(import_graph(root))
    assert cycles == [["vlaserve.checkpoint.weights", "vlaserve.config", "vlaserve.family",
                       "vlaserve.checkpoint.weights"]]


@pytest.mark.parametrize("statement", [
    "from .. import cli",  # a submodule named in a from-import
    "from ..cli import UsageError",
    "import vlaserve.cli",
    "from vlaserve.cli import UsageError",
])
def test_every_spelling_of_an_import_is_an_edge(tmp_path, statement):
    root = write(tmp_path, {
        "__init__.py": "",
        "cli.py": "def run():\n    from .fleet.command import add_parser\n",
        "fleet/__init__.py": "",
        "fleet/command.py": f"def options():\n    {statement}\n",
    })
    assert find_cycles(import_graph(root)) == [["vlaserve.cli", "vlaserve.fleet.command", "vlaserve.cli"]]


def test_a_layer_importing_upwards_is_found(tmp_path):
    root = write(tmp_path, {
        "__init__.py": "",
        "errors.py": "",
        "types.py": "from .errors import InvalidInput\ndef to(x):\n    from .processing.images import place_frames\n",
        "processing/__init__.py": "",
        "processing/images.py": "",
        "runtime/__init__.py": "",
        "runtime/batcher.py": "from ..policy import Policy\n",
        "policy.py": "",
    })
    assert layering_violations(import_graph(root)) == [
        "vlaserve.runtime.batcher imports vlaserve.policy, a layer above it",
        "vlaserve.types imports vlaserve.processing.images (it may import only vlaserve.errors)"]


def test_the_runtime_may_use_processings_image_math_only_and_never_start_up(tmp_path):
    root = write(tmp_path, {
        "__init__.py": "",
        "processing/__init__.py": "",
        "processing/images.py": "",
        "processing/prepare.py": "",
        "startup/__init__.py": "",
        "startup/plan.py": "",
        "runtime/__init__.py": "",
        "runtime/transfer.py": "from ..processing.images import finish_frame\nfrom ..processing.prepare import Preprocessor\n",
        "runtime/runner.py": "def go():\n    from ..startup.plan import capture_plan\n",
    })
    assert layering_violations(import_graph(root)) == [
        "vlaserve.runtime.runner imports vlaserve.startup.plan, a layer above it",
        "vlaserve.runtime.transfer imports vlaserve.processing.prepare, a layer above it"]


def test_an_acyclic_package_passes(tmp_path):
    root = write(tmp_path, {
        "__init__.py": "from .errors import VlaserveError\n",
        "errors.py": "class VlaserveError(Exception): ...\n",
        "types.py": "from .errors import VlaserveError\n",
        "policy.py": "from .types import Request\ndef go():\n    import ray\n",
    })
    graph = import_graph(root)
    assert graph["vlaserve.policy"] == {"vlaserve.types"} and find_cycles(graph) == []

"""Every import of tests/, bench/ and the client is declared where its users install from.

A package installed by hand passes on a developer's machine and fails on a user's: the README's test
command, in a fresh venv, gets exactly the dependencies and the test extra. So each file's imports are
read (ast), each third-party module is mapped to its distribution, and that distribution must be in the
dependency closure of what that file's install declares.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CLIENT_PROJECT = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]

# Installed beside the extras with --no-deps, because their pins clash with ours (openpi-client 0.1.2
# wants numpy < 2, lerobot 0.6.1 torch < 2.12): distribution -> (file, the install there that brings it).
INSTALLED_BESIDE = {
    "openpi-client": ("README.md", "pip install --no-deps openpi-client==0.1.2"),
    "lerobot": ("bench/prepare_device.sh", "lerobot==0.6.1"),
}
# Module -> distribution, for the modules that the test install does not bring, so that this machine's
# metadata cannot map them: the CUDA-only wheels, lerobot (Python >= 3.12), and the bench extra's plots and
# GPU counters. `nvidia` is the namespace of the CUDA libraries that torch's CUDA builds depend on.
NOT_INSTALLED_FOR_TESTS = {
    "quack": "quack-kernels", "cutlass": "nvidia-cutlass-dsl", "flash_attn": "flash-attn-4",
    "fa3_fwd_interface": "fa3-fwd", "lerobot": "lerobot", "pynvml": "nvidia-ml-py", "matplotlib": "matplotlib",
    "nvidia": "torch",
}
# Modules of this repository: the packages, and the test and bench helpers that put their folder on sys.path.
LOCAL = ({p.name for src in ("src", "client/src") for p in (ROOT / src).iterdir() if (p / "__init__.py").exists()}
         | {f.stem for folder in ("tests", "bench") for f in (ROOT / folder).glob("*.py")})


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_requirement(requirement: str) -> tuple[str, set[str]]:
    """'ray[serve]>=2.60; python_version>"3"' -> ('ray', {'serve'})."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", requirement)
    return normalize(m[1]), {normalize(e) for e in (m[2] or "").split(",") if e.strip()}


def closure(requirements: list[str]) -> set[str]:
    """The distributions these requirements install, through each installed one's own requirements
    (with the extras asked for). Markers other than `extra` are not evaluated: over-inclusive at worst."""
    names, done, todo = set(), set(), [parse_requirement(r) for r in requirements]
    while todo:
        name, extras = todo.pop()
        names.add(name)
        for extra in {None, *extras}:
            if (name, extra) in done:
                continue
            done.add((name, extra))
            try:
                requires = metadata.requires(name) or []
            except metadata.PackageNotFoundError:
                continue
            for r in requires:
                wanted = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", r)
                if (normalize(wanted[1]) if wanted else None) == extra:
                    todo.append(parse_requirement(r))
    return names


def third_party_imports(source: str) -> set[str]:
    """Top-level names of the absolute imports in a file, anywhere in it, that are neither the standard
    library nor this repository's own."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules = [node.module]
        else:
            continue
        found |= {m.split(".")[0] for m in modules}
    return {m for m in found if m not in sys.stdlib_module_names and m not in LOCAL}


def undeclared(sources: dict[str, str], requirements: list[str], where: str) -> list[str]:
    """One line per file and module that no distribution in `requirements`' closure provides.
    `sources`: file name -> its text."""
    declared, installed = closure(requirements), metadata.packages_distributions()
    problems = []
    for name, source in sources.items():
        for module in sorted(third_party_imports(source)):
            if module in installed:
                distributions = {normalize(d) for d in installed[module]}
            elif module in NOT_INSTALLED_FOR_TESTS:
                distributions = {NOT_INSTALLED_FOR_TESTS[module]}
            else:
                problems.append(f"{name} imports {module}, which is not installed here, so its distribution "
                                f"is unknown: declare it in {where} and install it")
                continue
            if not distributions & declared:
                problems.append(f"{name} imports {module} (distribution {', '.join(sorted(distributions))}), "
                                f"not declared in {where}")
    return problems


BESIDE = list(INSTALLED_BESIDE)
SOURCES = {
    # files: (requirements they may import from, where a missing one belongs)
    "tests": (PROJECT["dependencies"] + EXTRAS["test"] + BESIDE, "pyproject.toml's dependencies or test extra"),
    "bench": (PROJECT["dependencies"] + EXTRAS["bench"] + EXTRAS["cute"] + BESIDE,
              "pyproject.toml's dependencies, bench extra or (CUDA-only) cute extra"),
    # The robot's install: client/pyproject.toml alone (no torch, not the server's dependencies).
    "client/src": (CLIENT_PROJECT["dependencies"], "client/pyproject.toml's dependencies"),
}


@pytest.mark.parametrize("folder", list(SOURCES))
def test_every_import_is_declared(folder):
    requirements, where = SOURCES[folder]
    sources = {str(f.relative_to(ROOT)): f.read_text() for f in sorted((ROOT / folder).rglob("*.py"))}
    assert sources
    problems = undeclared(sources, requirements, where)
    assert not problems, "\n".join(problems)


def test_an_undeclared_import_is_named():
    """The check itself can fail: hypothesis is installed here (the test extra), but the dependencies
    alone lack it; a module nothing installs is named too; numpy (declared), os (standard library), a
    relative import and the repository's own modules pass."""
    source = ("import os\nimport numpy\nfrom hypothesis import given\nimport no_such_module_here\n"
              "from . import x\nimport vlaserve_client\nfrom fixtures import fixture_dir\n")
    assert undeclared({"tests/test_x.py": source}, PROJECT["dependencies"], "the dependencies") == [
        "tests/test_x.py imports hypothesis (distribution hypothesis), not declared in the dependencies",
        "tests/test_x.py imports no_such_module_here, which is not installed here, so its distribution is "
        "unknown: declare it in the dependencies and install it",
    ]


@pytest.mark.parametrize("distribution", BESIDE)
def test_what_is_installed_beside_is_installed_by_the_named_command(distribution):
    file, command = INSTALLED_BESIDE[distribution]
    assert command in (ROOT / file).read_text(), f"{file} no longer installs {distribution} ({command!r})"

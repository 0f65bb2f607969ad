"""Every code example in README.md and docs/*.md runs as written.

The convention, in the markdown:
- ```python, ```bash and ```sh blocks run; other blocks (json, yaml, plain text) are shown, not run.
- `<!-- not run: REASON -->` on the line right before a fence: not run; the test reports it as a skip
  with REASON (a CUDA GPU, a real checkpoint, network, a Ray cluster). Blocks that `pip install`
  are not run either, without a mark.
- `<!-- continues -->` right before a fence: the block runs after the previous runnable block of the
  same file, as one program (a fragment that uses what the block before it defined).

How they run: against the demo server (`vlaserve serve` with no checkpoint), started once on a free
port; every `8000` in a block is replaced by that port. Each block runs in an empty directory with
HF_HUB_OFFLINE=1. A python block runs in a fresh interpreter and must exit 0 with nothing on stderr
(a warning there, such as "the chunk ran out", means the example misbehaves as written). A bash block
runs under `bash -e`, where `vlaserve serve ...` starts that server on a free port of its own, waits
until /healthz answers 200 and stops it with Ctrl-C, which must end it with exit 0.

docs/benchmarks.md is a measurement log: its commands are the benches' (GPU runs), not examples.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from test_server import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")]
RUNNABLE = {"python": "python", "bash": "bash", "sh": "bash"}
FENCE = re.compile(r"^```(\S*)\s*$")
MARK = re.compile(r"^<!-- (not run: (?P<reason>.+?)|(?P<continues>continues)) -->$")
EXAMPLE_PORT = re.compile(r"\b8000\b")

# `vlaserve` inside bash blocks: the CLI, except that `serve` is started, checked and stopped.
BASH_PRELUDE = r"""
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
vlaserve() {
  if [ "$1" != serve ]; then "$PYTHON" -m vlaserve.cli "$@"; return; fi
  local port; port=$(free_port)
  "$PYTHON" -m vlaserve.cli "$@" --port "$port" & local pid=$!
  until curl -sf "127.0.0.1:$port/healthz" > /dev/null; do
    kill -0 "$pid" 2> /dev/null || { wait "$pid"; echo "vlaserve $* exited before it was ready" >&2; return 1; }
    sleep 0.2
  done
  kill -INT "$pid"; wait "$pid"
}
"""


@dataclass
class Example:
    path: Path
    line: int  # of the first fence
    language: str  # "python" or "bash"
    code: str
    not_run: str | None  # the reason, when it is not run

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def examples_in(path: Path) -> list[Example]:
    lines = path.read_text().splitlines()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        language, code = fence.group(1), "\n".join(lines[i + 1:end]) + "\n"
        mark = MARK.match(lines[i - 1]) if i else None
        line, i = i + 1, end + 1
        if language not in RUNNABLE:
            assert mark is None, f"{path.name}:{end}: a mark on a {language or 'plain'} block, which never runs"
            continue
        language = RUNNABLE[language]
        if mark and mark.group("continues"):
            assert found and found[-1].language == language, f"{path.name}:{end}: nothing of its language to continue"
            found[-1].code += code
            continue
        reason = mark.group("reason") if mark else None
        if reason is None and language == "bash" and "pip install" in code:
            reason = "installs packages"
        found.append(Example(path, line, language, code, reason))
    return found


EXAMPLES = [example for path in DOCS for example in examples_in(path)]


def test_marks_are_well_formed():
    """A mark that does not parse would silently run (or not run) the block: every `<!--` line before a
    fence must be one of the two marks."""
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines[1:], 1):
            if FENCE.match(line) and line != "```" and lines[i - 1].startswith("<!--"):
                assert MARK.match(lines[i - 1]), f"{path.name}:{i}: unknown mark {lines[i - 1]!r}"


@pytest.fixture(scope="module")
def demo_env(tmp_path_factory) -> dict:
    """The environment every example runs in: offline, with the demo checkpoints in a cache of their own."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "VLASERVE_CACHE": str(tmp_path_factory.mktemp("cache")),
            "PYTHON": sys.executable, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


@pytest.fixture(scope="module")
def demo_server(demo_env, tmp_path_factory):
    server = ServerProcess([], tmp_path_factory.mktemp("server") / "log", env=demo_env)
    server.wait_ready()
    yield server
    assert server.stop() == 0, server.log()


# Examples that start servers take 5-15 s each on 2 cores: the full run only.
STARTS_SERVER = re.compile(r"^[^#]*\bvlaserve serve\b", re.MULTILINE)


@pytest.mark.parametrize("example", [pytest.param(e, id=e.name, marks=[pytest.mark.slow] * bool(
    e.language == "bash" and STARTS_SERVER.search(e.code))) for e in EXAMPLES])
def test_example_runs(example, demo_server, demo_env, tmp_path):
    if example.not_run:
        pytest.skip(f"not run: {example.not_run}")
    run_example(example, Path(sys.executable), demo_server.port, demo_env, tmp_path)


def run_example(example: Example, python: Path, port: int, env: dict, tmp_path: Path) -> None:
    code = EXAMPLE_PORT.sub(str(port), example.code)
    if example.language == "python":
        (tmp_path / "example.py").write_text(code)
        command = [str(python), "example.py"]
    else:
        (tmp_path / "example.sh").write_text(BASH_PRELUDE + code)
        command = ["bash", "-e", "-o", "pipefail", "example.sh"]
    env = {**env, "PYTHON": str(python), "PATH": f"{python.parent}{os.pathsep}{env['PATH']}"}
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    report = f"{example.name} ({example.language}, {python}):\n{code}\n--- stdout\n{run.stdout}\n--- stderr\n{run.stderr}"
    assert run.returncode == 0, report
    if example.language == "python":
        assert run.stderr == "", report
        assert run.stdout.strip(), f"prints nothing, so it shows its reader nothing: {report}"


# ---- each page's examples in the install the page names (issue 79: the test venv hid a missing httpx) ----------
# A page names its install on a line of its own, `<!-- examples run in: pip install -e . httpx -->` (commands joined
# by &&, run from the repository root); a page without one runs in the server's install, as the README gives it.
INSTALL_MARK = re.compile(r"^<!-- examples run in: (?P<install>pip install .+?) -->$", re.MULTILINE)
SERVER_INSTALL = "pip install -e ."
# The README's CPU torch, installed first in every venv (the package index it names; a plain index gives CUDA's).
CPU_TORCH = ["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu"]


def page_install(path: Path) -> str:
    marks = INSTALL_MARK.findall(path.read_text())
    assert len(marks) <= 1, f"{path.name}: more than one install mark"
    return marks[0] if marks else SERVER_INSTALL


@pytest.fixture(scope="session")
def page_venv(tmp_path_factory):
    """The python of a fresh venv holding exactly CPU torch and the page's install (one venv per install)."""
    made: dict[str, Path] = {}

    def python_for(install: str) -> Path:
        if install not in made:
            root = tmp_path_factory.mktemp("venv")
            subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
            python = root / "bin" / "python"
            pip = [str(python), "-m", "pip", "install", "-q"]
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of this venv leaks in
            commands = [pip + shlex.split(c.strip().removeprefix("pip install ")) for c in install.split("&&")]
            if any(a == "-e" and b.split("[")[0] == "." for c in commands for a, b in zip(c, c[1:])):
                commands.insert(0, pip + CPU_TORCH)  # the server's install: the README's CPU torch first
            for command in commands:
                done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
                assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            made[install] = python
        return made[install]

    return python_for


@pytest.mark.slow
@pytest.mark.parametrize("example", [pytest.param(e, id=e.name) for e in EXAMPLES if not e.not_run])
def test_example_runs_in_the_install_its_page_names(example, demo_server, demo_env, page_venv, tmp_path):
    env = {k: v for k, v in demo_env.items() if k != "PYTHONPATH"}
    run_example(example, page_venv(page_install(example.path)), demo_server.port, env, tmp_path)


def test_documented_metrics_are_the_served_ones(demo_server):
    """docs/server.md names exactly the metric families /metrics exposes (prometheus_client's own
    `*_created` timestamps aside)."""
    # the client package (vlaserve_client, vlaserve_client.X) is no metric
    documented = set(re.findall(r"\bvlaserve_[a-z_]+\b(?!\.)", (ROOT / "docs" / "server.md").read_text())) - {
        "vlaserve_client"}
    families = re.findall(r"^# TYPE (\S+) ", httpx.get(demo_server.url + "/metrics").text, re.MULTILINE)
    assert documented == {name for name in families if not name.endswith("_created")}



def resolve(dotted: str):
    """The object a dotted name (`module.attribute` or `module:attribute`) names: the longest prefix that
    imports as a module, then attributes."""
    parts = dotted.replace(":", ".").split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[n:]:
            obj = getattr(obj, attribute)
        return obj


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's, on importing vlaserve.fleet.target
def test_documented_python_names_exist():
    """Every `vlaserve.module[.attribute]` (or `module:attribute`) the docs name, loggers aside, can be imported."""
    for path in DOCS:
        for dotted in sorted(set(re.findall(r"(?<!logger )`(vlaserve(?:\.\w+)+(?::\w+)?)", path.read_text()))):
            try:
                resolve(dotted)
            except AttributeError as e:
                pytest.fail(f"{path.name}: {dotted}: {e}")


def test_every_serve_option_is_documented():
    """docs/server.md's option table has a row for each `vlaserve serve` option, as its flag is spelled
    (an option on by default by its --no- switch)."""
    from vlaserve.options import CONFIG_FILE_ONLY, SERVE_OPTIONS

    text = (ROOT / "docs" / "server.md").read_text()
    rows = set(re.findall(r"^\| `(--[a-z0-9-]+)`", text, re.MULTILINE))
    keys = set(re.findall(r"^\| `([a-z0-9_]+)`", text, re.MULTILINE))  # the config file's own keys
    for name, (kind, default, _, _) in SERVE_OPTIONS.items():
        if name in CONFIG_FILE_ONLY:
            assert name in keys, name
            continue
        flag = name.replace("_", "-")
        assert f"--{'no-' if kind is bool and default is True else ''}{flag}" in rows, name

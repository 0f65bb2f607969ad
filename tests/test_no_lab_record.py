"""src/ holds code and why, not the lab record: no run numbers, no timing tables, no machines or commit
pairs, no citation of a script that is not in the tree (the evidence lives once, in docs/performance.md
and docs/benchmarks.md). The user docs (README.md, docs/*.md) hold figures, but cite no run, commit or
lab session either: a figure points to its section of docs/benchmarks.md, and git keeps the history."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

RULES = {
    "a run number": re.compile(r"\bruns? [0-9]{2,3}\b"),
    "a timing table (two timings on a line)": re.compile(r"\d(\.\d+)? ?(us|µs|ms)\b.*\d(\.\d+)? ?(us|µs|ms)\b"),
    "a before/after pair of figures": re.compile(r"\b\d+\.\d+ ?(->|against|vs\.?) ?\d+\.\d+\b"),
    "a machine": re.compile(r"\b(on|of) (an?|the) H[12]00\b|\bH[12]00 (host|machine|server)\b"),
    "a file at a commit": re.compile(r"\b[0-9a-f]{7,40}:[\w/.-]+"),
    "a date": re.compile(r"\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b"),
}
# The docs state figures with their GPU and date, so only these hold there (and the cited scripts'
# existence). A commit: a letter and a digit among 7-40 hex characters in backticks, after "commit" or
# before ":path", or 7-12 of them standing alone (a 32-character request id is no commit).
COMMIT = r"(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}"
SHORT_COMMIT = r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b"
DOC_RULES = {
    "a run number": re.compile(r"\b[Rr]uns? [0-9]{2,3}\b|\[runs? [0-9]+\]"),
    "a run column": re.compile(r"\|\s*runs?\s*\||\(runs?\)"),
    "a commit": re.compile(rf"`{COMMIT}[`:]|\bcommit `?{COMMIT}\b|\b{COMMIT}:[\w/.-]+|{SHORT_COMMIT}"),
    "a lab session": re.compile(r"\b(session|wave) [0-9]+\b", re.IGNORECASE),
}
# Scripts the source and the docs may name (bench/X.py, tests/X.py) must exist.
CITED_SCRIPT = re.compile(r"\b((?:bench|tests)/[\w/]+\.py)\b")


def findings(path: Path, rules: dict[str, re.Pattern] = RULES) -> list[str]:
    text = path.read_text(encoding="utf-8")
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        out += [f"{n}: {what}: {line.strip()}" for what, rule in rules.items() if rule.search(line)]
        out += [f"{n}: cites {script}, not in the tree: {line.strip()}" for script in CITED_SCRIPT.findall(line)
                if not (ROOT / script).is_file()]
    return out


def test_no_lab_record_in_src():
    dirty = {str(p.relative_to(SRC)): f for p in sorted(SRC.rglob("*.py")) if (f := findings(p))}
    assert not dirty, "\n".join(f"{name}:{line}" for name, f in dirty.items() for line in f)


def test_the_rules_catch_what_they_are_for(tmp_path):
    # Each rule against a line it must flag and one it must let through.
    sample = tmp_path / "sample.py"
    flagged = ["# measured in run 254", "# b1 29.2 -> 22.5", "# 1154 against 1331 us a layer, 30 ms",
               "# on an H200 it was faster", "# see 05f44b8:bench/probes/x.py", "# (2026-12-04)",
               "# bench/gone_forever.py sweeps it"]
    sample.write_text("\n".join(flagged) + "\n")
    assert len({f.split(":")[0] for f in findings(sample)}) == len(flagged)
    sample.write_text("# runs the prefix; Target(90, 'H100, H200'); bench/bench_gpu.py; 1 ms buckets\n")
    assert findings(sample) == []


def test_no_lab_record_in_user_docs():
    dirty = {p.name: f for p in USER_DOCS if (f := findings(p, DOC_RULES))}
    assert not dirty, "\n".join(f"{name}:{line}" for name, f in dirty.items() for line in f)


def test_the_doc_rules_catch_what_they_are_for(tmp_path):
    sample = tmp_path / "sample.md"
    flagged = ["1.96 GiB (benchmarks.md runs 30-33)", "103 ms per request ([run 14](benchmarks.md))",
               "| change | b1 | run |", "| measured when it came in (run) |", "kept at commit `0bdbea4`",
               "(`810a0ee:bench/probes/x.py`)", "import no torch (b2b86b0 in git)", "Why (2-core VM, session 14)",
               "the third Wave 2 helper", "`python3 bench/probes/gone.py CK`"]
    sample.write_text("\n".join(flagged) + "\n")
    assert len({f.split(":")[0] for f in findings(sample, DOC_RULES)}) == len(flagged)
    sample.write_text("vlaserve runs 8 held-out inputs; `sm89` uses 64-query tiles; the run-to-run spread; "
                      '"created": 1796040960; 2026-12-04 on an H200; `--graph-batches 1,2,4,8`\n')
    assert findings(sample, DOC_RULES) == []

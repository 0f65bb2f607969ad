"""Every relative link in README.md and docs/*.md leads somewhere: the file exists, and a #fragment into a
Markdown page names one of its headings (GitHub's anchor: lower case, punctuation dropped, spaces as hyphens,
a repeated heading suffixed -1, -2) or an explicit <a id>/<a name>."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"#{1,6} (.+)")
EXPLICIT_ANCHOR = re.compile(r'<a (?:name|id)="([^"]+)"')


def heading_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    found, seen, in_fence = set(EXPLICIT_ANCHOR.findall(text)), {}, False
    for line in text.splitlines():
        in_fence ^= line.startswith("```")
        if not in_fence and (m := HEADING.match(line)):
            anchor = heading_anchor(m.group(1))
            found.add(f"{anchor}-{seen[anchor]}" if anchor in seen else anchor)
            seen[anchor] = seen.get(anchor, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    out = []
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, fragment = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                out.append(f"{page.name}:{n}: no file {target}")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                out.append(f"{page.name}:{n}: no heading for #{fragment} in {dest.name}")
    return out


def test_every_doc_link_leads_somewhere():
    broken = [b for page in USER_DOCS for b in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_the_link_check_catches_what_it_is_for(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## The server: start-up (`bench_serve.py`)\n\n## Repeated\n\n## Repeated\n\n"
                    "```\n# not a heading\n```\n\n"
                    "[ok](#the-server-start-up-bench_servepy) [ok](#repeated-1) [ok](page.md#a-page)\n"
                    "[gone](missing.md) [gone](#the-server) [gone](#not-a-heading) [gone](page.md#repeated-2)\n")
    assert [b.split(": ", 1)[1] for b in broken_links(page)] == [
        "no file missing.md", "no heading for #the-server in page.md",
        "no heading for #not-a-heading in page.md", "no heading for #repeated-2 in page.md"]

"""The user documentation: README.md and docs/**/*.md.

Every relative link resolves (to a file or directory, and to a heading when it names an anchor
in a markdown file), the README stays short, and it starts with the two commands a user runs
first. No TensorFlow import: these tests read text only.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 350

# [text](target) or [text](target "title"); images (![alt](src)) match too. The text may hold
# backticks and brackets-free inline code; nested brackets are not used in these documents.
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def _markdown_files() -> list[Path]:
    files = [README] + sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.is_file()]


def _prose_lines(text: str) -> list[str]:
    """The lines of `text` with fenced code blocks and inline code spans (which may run over a
    line break) blanked out, so that the line numbers stay."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else line)
    prose = "\n".join(lines)
    blank = lambda m: re.sub(r"[^\n]", " ", m.group())
    return re.sub(r"``.*?``|`[^`]*`", blank, prose, flags=re.S).split("\n")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation other than '-' and
    spaces removed, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if not m:
            continue
        slug = _slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: Path) -> list[tuple[int, str]]:
    found = []
    for k, line in enumerate(_prose_lines(path.read_text(encoding="utf-8")), 1):
        for m in _LINK.finditer(line):
            found.append((k, m.group(1)))
    return found


def _broken_links(path: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for k, target in _links(path):
        if re.match(r"^(https?:|mailto:)", target, re.I) or target.startswith("#"):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve()
        where = f"{path.relative_to(root)}:{k}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file or directory)")
        elif anchor and dest.suffix == ".md" and anchor.lower() not in _anchors(dest):
            broken.append(f"{where} (no heading with anchor #{anchor} in {file_part})")
    return broken


@pytest.mark.timeout(60)
def test_documents_exist():
    files = _markdown_files()
    assert README in files
    assert len(files) > 1, "docs/ holds no markdown pages"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = _broken_links(path)
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.timeout(60)
def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    )


@pytest.mark.timeout(60)
def test_readme_starts_with_demo_then_test():
    text = README.read_text(encoding="utf-8")
    head = "\n".join(text.splitlines()[:40])
    assert "scripts/demo" in head, "scripts/demo is not in README.md's first 40 lines"
    assert "scripts/test" in head, "scripts/test is not in README.md's first 40 lines"
    assert text.index("scripts/demo") < text.index("scripts/test")


@pytest.mark.timeout(60)
def test_slug_rule():
    assert _slug('Tested across "machines": the multihost tier') == (
        "tested-across-machines-the-multihost-tier"
    )
    assert _slug("`tfstrat doctor`") == "tfstrat-doctor"
    assert _slug("The runs' folders") == "the-runs-folders"
    assert _slug("LocalSGD and DiLoCo") == "localsgd-and-diloco"


@pytest.mark.timeout(60)
def test_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n", encoding="utf-8")
    page.write_text(
        "[ok](other.md) [ok](other.md#a-section) [web](https://example.com) [top](#x)\n"
        "`[code](missing.md)` and `a span over\n[a line](missing.md)`\n"
        "[gone](missing.md) [bad anchor](other.md#nothing)\n",
        encoding="utf-8",
    )
    targets = [t for _, t in _links(page)]
    assert "missing.md" in targets and "other.md#nothing" in targets
    assert targets.count("missing.md") == 1  # the one in inline code is not a link
    broken = _broken_links(page, root=tmp_path)
    assert len(broken) == 2, broken

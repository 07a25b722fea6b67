"""The repository documents itself: no tracked file cites documents that live outside it (a
clone has none of them), and every relative link in README.md and docs/*.md leads to a file of
the repository (and, with a #fragment, to a heading of that file)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.utils import REPO_ROOT

THIS_FILE = Path(__file__).resolve()

# Documents kept outside the repository in its early days, and the ways code and text cited them.
_OUTSIDE = [
    re.compile(r"\b(?:SPEC|PERF|METHOD|ARCHITECTURE)\.md\b"),
    re.compile(r"\bSPEC\b"),  # the word alone, as citations of the spec wrote it
    re.compile(r"\.\./shared\b"),
    re.compile(r"""\.parent\s*/\s*["']shared["']"""),  # the same path built with pathlib
]

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def outside_references(text: str) -> list[str]:
    """The lines of `text` that cite a document outside the repository."""
    return [line.strip() for line in text.splitlines() if any(p.search(line) for p in _OUTSIDE)]


def _tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    return [REPO_ROOT / name for name in out.decode().split("\0") if name]


def _markdown_pages() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def _without_code_blocks(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: link syntax and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors, seen = set(), {}
    for line in _without_code_blocks(page.read_text(encoding="utf-8")):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_checker_sees_outside_references():
    # Spelled in pieces, so that this file holds no citation itself (a grep stays clean).
    spec, perf, outside = "SP" + "EC", "PE" + "RF", "../" + "shared"
    cited = [f"split-KV schedule ({spec} §6)", f"see {spec}.md", f"{perf}.md's XLA", f"at {spec} tolerances",
             f"{outside}/anchor", 'REPO_ROOT.parent / "sha' + 'red" / "conformance"']
    assert [outside_references(line) for line in cited] == [[line] for line in cited]
    assert outside_references("docs/formats.md, V32; PartitionSpec; shared memory; SPECIAL") == []


def test_no_references_outside_the_repository():
    found = []
    for path in _tracked_files():
        if path.resolve() == THIS_FILE or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # binary data (conformance vectors)
            continue
        found += [f"{path.relative_to(REPO_ROOT)}: {line}" for line in outside_references(text)]
    assert not found, "references to documents outside the repository (cite docs/ instead):\n" + "\n".join(found)


def test_docs_exist_and_are_indexed():
    index = (REPO_ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    pages = {p.name for p in (REPO_ROOT / "docs").glob("*.md")} - {"README.md"}
    assert {"formats.md", "numerics.md", "schedule.md", "sharding.md", "performance.md"} <= pages
    linked = {target for target in _LINK.findall(index)}
    assert pages <= linked, f"docs/README.md does not link {sorted(pages - linked)}"


@pytest.mark.parametrize("page", _markdown_pages(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for line in _without_code_blocks(page.read_text(encoding="utf-8")):
        for target in _LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page.resolve()
            if not dest.is_relative_to(REPO_ROOT) or not dest.exists():
                broken.append(f"{target}: no such file in the repository")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(REPO_ROOT)}")
    assert not broken, f"{page.relative_to(REPO_ROOT)}:\n" + "\n".join(broken)

"""The front door works as written: the README's quickstart runs as it stands, the README stays
short, and every relative link in the README and docs/ leads to a file (and heading) in the
repository."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_LIMIT = 10 * 1024

# [text](target) and [text]: target; the target ends at whitespace or the closing parenthesis.
INLINE_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def quickstart_block(text: str) -> str:
    """The first ```python block under the Quickstart heading (before the next heading of its level;
    lines inside fences, such as a Python comment, are not headings)."""
    level, in_fence, block = None, False, None
    for line in text.splitlines(keepends=True):
        fence = line.startswith("```")
        if level is None:
            heading = re.match(r"(#+)\s+Quickstart\s*$", line)
            if heading and not in_fence:
                level = len(heading.group(1))
            in_fence ^= fence
            continue
        if block is not None:
            if fence:
                return "".join(block)
            block.append(line)
            continue
        if not in_fence and re.match(rf"#{{1,{level}}}\s", line):
            break
        if not in_fence and re.match(r"```python\s*$", line):
            block = []
        in_fence ^= fence
    assert level is not None, "README.md has no Quickstart heading"
    raise AssertionError("the Quickstart section has no ```python block")


def without_code(text: str) -> str:
    """Markdown with fenced blocks and inline code removed: links are not looked for inside code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def relative_links(path: Path) -> list:
    text = without_code(path.read_text(encoding="utf-8"))
    targets = INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)
    return [t for t in targets if not EXTERNAL.match(t)]


def anchors(path: Path) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+\s+(.*)$", text, re.M)}


def test_readme_quickstart_runs_as_it_stands(tmp_path):
    code = quickstart_block(README.read_text(encoding="utf-8"))
    script = tmp_path / "quickstart.py"
    script.write_text(code, encoding="utf-8")
    env = dict(os.environ)
    # The checkout's offtensor, whichever directory the test runs from.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"the README's quickstart failed:\n{done.stdout}\n{done.stderr}"
    assert "OffloadStats(" in done.stdout


def test_readme_is_at_most_10_kib():
    size = README.stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes; the limit is {README_LIMIT}: move detail into docs/"


@pytest.mark.parametrize("page", [README] + DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(page):
    broken = []
    for target in relative_links(page):
        file_part = target.split("#", 1)[0]
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            broken.append(target)
        elif "#" in target and resolved.suffix == ".md" and target.split("#", 1)[1] not in anchors(resolved):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to what is not in the repository: {broken}"


def test_docs_exist():
    names = {p.name for p in DOCS}
    for name in ("design.md", "guarantees.md", "composing.md", "moe.md", "plans.md", "benchmarks.md",
                 "compile.md", "testing.md", "limits.md", "usage.md"):
        assert name in names, f"docs/{name} is missing"


def test_the_testing_page_names_every_test_file_and_no_file_that_is_gone():
    """docs/testing.md is where a reader finds which file proves what: a test file left out of it,
    or a name kept after its file was split or removed, sends the reader nowhere."""
    text = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    named = set(re.findall(r"`(test_\w+\.py)`", text))
    assert not files - named, f"docs/testing.md does not name {sorted(files - named)}"
    assert not named - files, f"docs/testing.md names test files that do not exist: {sorted(named - files)}"


@pytest.mark.parametrize("page", [README] + DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_pages_carry_no_development_journal(page):
    """Users read facts: no issue numbers, dates of work or pointers outside the repository."""
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"\bissue \d+", text, re.I), f"{page.name} names an issue number"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), f"{page.name} carries a date"
    assert "../shared" not in text and "DESIGN.md" not in text, f"{page.name} points outside the repository"

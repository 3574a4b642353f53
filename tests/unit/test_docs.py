"""The documentation a newcomer reads: every relative link resolves, the README stays short and holds the commands
CI runs, and the walk-through of one step names files and functions that exist.

Anchors follow GitHub's rule for headings: lowercase, punctuation dropped except `-` and `_`, spaces to `-`, and
`-1`, `-2`, ... after a repeated heading.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md"]
README_MAX_LINES = 400

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\n\s*\n).)+?\1", re.DOTALL)  # inline code, never across a blank line
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _unfenced(text: str) -> str:
    """`text` with the lines of fenced code blocks blanked: headings are found in what is left."""
    kept, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            kept.append("")
            continue
        kept.append("" if fenced else line)
    return "\n".join(kept)


def _prose(text: str) -> str:
    """`text` without fenced code blocks and inline code: what is left is where links are."""
    return _CODE_SPAN.sub("", _unfenced(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of every heading of a Markdown file (outside code blocks)."""
    seen: dict[str, int] = {}
    found = set()
    for line in _unfenced(path.read_text()).splitlines():
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    """Every relative link and image target of a Markdown file (external addresses left out)."""
    targets = _LINK.findall(_prose(path.read_text()))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.IGNORECASE)]


def broken_links(path: Path) -> list[str]:
    """The links of `path` that name a file that does not exist, or an anchor that is no heading of its file."""
    broken = []
    for target in links(path):
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading '#{anchor}' in {dest}")
    return broken


def test_slug_follows_github():
    assert slug("Planning memory (`launch/plan.py`)") == "planning-memory-launchplanpy"
    assert slug("Mixture of experts and expert parallelism (`model=moe`, `strategy=expert`)") == \
        "mixture-of-experts-and-expert-parallelism-modelmoe-strategyexpert"
    assert slug("Your own data, loss and optimizer") == "your-own-data-loss-and-optimizer"
    assert slug("Fine-tuning") == "fine-tuning"


def test_links_outside_code_only(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n\n## A section\n")
    page.write_text("# Page\n\n[ok](other.md#a-section-1) [self](#page) `[not](a-link.md)`\n\n"
                    "```\n[not](either.md)\n```\n\n[web](https://example.com) [bad](other.md#missing)\n"
                    "![gone](gone.png)\n")
    assert links(page) == ["other.md#a-section-1", "#page", "other.md#missing", "gone.png"]
    problems = broken_links(page)
    assert len(problems) == 2 and "#missing" in problems[0] and "gone.png" in problems[1]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert path.exists(), path
    assert broken_links(path) == []


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): " \
        "move the depth to docs/"


def test_readme_holds_what_ci_runs_and_the_suite_time():
    """CI (.ci/run) runs exactly the README's test command; the README says how long the whole suite takes."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    command = next(line for line in ci if "python -m pytest" in line and not line.startswith("#"))
    readme = (ROOT / "README.md").read_text()
    assert command in [line.strip() for line in readme.splitlines()], command
    assert re.search(r"^The whole suite.* \d+ min", readme, re.MULTILINE), "the suite's measured time"


def _hops() -> list[tuple[str, list[str]]]:
    """(file, functions) of each row of the walk-through's tables: `| hop | `file` | `f`, `C.m` | ... |`."""
    rows = []
    for line in (ROOT / "docs" / "walkthrough.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            rows.append((cells[1].strip("`"), re.findall(r"`([\w.]+)`", cells[2])))
    return rows


def test_walkthrough_names_what_exists():
    hops = _hops()
    assert len(hops) >= 10
    assert [int(c) for c in re.findall(r"^\| (\d+) \|", (ROOT / "docs" / "walkthrough.md").read_text(),
                                        re.MULTILINE)] == list(range(1, len(hops) + 1))
    modules = {f for f, _ in hops}
    # The page says how many modules a step passes: the count of its tables', not a cap (each hop a real one).
    (stated,) = re.findall(r"(\d+) modules in all", (ROOT / "docs" / "walkthrough.md").read_text())
    assert int(stated) == len(modules), sorted(modules)
    for file, names in hops:
        source = (ROOT / file).read_text()
        assert names, file
        for name in names:
            owner, _, member = name.rpartition(".")
            if owner:
                assert re.search(rf"^class {owner}\b", source, re.MULTILINE), f"{file}: no class {owner}"
                assert re.search(rf"^\s+def {member}\b", source, re.MULTILINE), f"{file}: no method {name}"
            else:
                assert re.search(rf"^(def|class) {name}\b", source, re.MULTILINE), f"{file}: no {name}"


def test_the_readme_layout_names_every_module_on_disk_and_nothing_else():
    """README's Layout tables: every module and package of parallel/ (and of parallel/planning/, named with its
    folder) is in them, and every name in their modules column is on disk."""
    text = (ROOT / "README.md").read_text()
    layout = text[text.index("## Layout"):text.index("## Where to read next")]
    named = set()
    for line in layout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and not all(c and set(c) <= set("-") for c in cells):
            column = cells[1] if len(cells) == 3 else cells[0]
            named |= set(re.findall(r"`([\w/]+(?:\.py|/))`", column))
    parallel = ROOT / "parallel"
    on_disk = {p.name + ("/" if p.is_dir() else "") for p in parallel.iterdir()
               if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())}
    on_disk = (on_disk - {"planning/"}) | {f"planning/{p.name}" for p in (parallel / "planning").glob("*.py")
                                           if p.name != "__init__.py"}
    assert on_disk - named == set(), f"modules the Layout does not name: {sorted(on_disk - named)}"
    assert named - on_disk == set(), f"names in the Layout with no module: {sorted(named - on_disk)}"


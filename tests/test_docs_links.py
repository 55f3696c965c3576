"""The README and the docs hold together: every relative link (and its #anchor) resolves, and the README's first
screen gives what a newcomer needs first, with the same set-up and test commands CI runs."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FIRST_SCREEN = 40  # lines: what a terminal or a repository page shows before scrolling


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold commands, not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    """Each relative link names a file of the repository, and each #anchor a heading of the page it points to."""
    links = relative_links(page)
    for target in links:
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.relative_to(ROOT)}: {target} does not exist"
        if anchor:
            assert resolved.suffix == ".md" and anchor in anchors(resolved), \
                f"{page.relative_to(ROOT)}: {target} names no heading of {resolved.relative_to(ROOT)}"


def test_every_docs_page_is_reachable_from_the_readme():
    """No page is orphaned: each docs/*.md is linked from the README or from a page the README links to."""
    reached, frontier = set(), [ROOT / "README.md"]
    while frontier:
        page = frontier.pop()
        for target in relative_links(page):
            path = (page.parent / target.partition("#")[0]).resolve()
            if path.suffix == ".md" and path.exists() and path not in reached:
                reached.add(path)
                frontier.append(path)
    orphans = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in reached]
    assert orphans == []


def test_the_readme_first_screen_says_what_it_is_how_to_install_and_the_ci_commands():
    """Within the first screen: one sentence of what it is, the install into ComfyUI, and the two set-up/test
    commands, which are the ones .ci/run runs; the whole README stays short enough to read."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 190
    first = "\n".join(lines[:FIRST_SCREEN])
    assert "ComfyUI" in first and "Qwen-Image-2.1" in first
    assert "custom_nodes" in first and "requirements.txt" in first
    ci = (ROOT / ".ci" / "run").read_text()
    setup = re.search(r"^python -m pip install -q (-e \S+)$", ci, flags=re.M).group(1)
    test = re.search(r"^(python -m pytest.*)$", ci, flags=re.M).group(1)
    assert f"pip install {setup}" in first and test in first


def test_the_set_up_blocks_say_torch_comes_first_and_run_cis_test_command():
    """The README's and docs/testing.md's set-up blocks: inside the block, torch (and torchvision) installed before
    the pack, as .ci/run does, then CI's own test command (`-rs`: skipped tests say why)."""
    ci = (ROOT / ".ci" / "run").read_text()
    torch_pin = re.search(r"^python -m pip install -q (torch==\S+ torchvision==\S+)$", ci, flags=re.M).group(1)
    test = re.search(r"^(python -m pytest.*)$", ci, flags=re.M).group(1)
    assert test == "python -m pytest -q -rs"
    for page in ("README.md", "docs/testing.md"):
        block = re.search(r"```bash\n((?:(?!```).)*pip install -e(?:(?!```).)*)```", (ROOT / page).read_text(), flags=re.S).group(1)
        lines = block.splitlines()
        assert f"pip install {torch_pin}" in lines[0], page
        assert lines[1].startswith("pip install -e") and lines[2].startswith(test + " "), page

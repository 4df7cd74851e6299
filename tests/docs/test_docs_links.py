"""Every relative link in README.md, docs/, deploy/ and the notebooks resolves
(file exists; a `#fragment` into a Markdown file names one of its headings)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def markdown_text(path: Path) -> str:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return path.read_text()


def anchors_of(path: Path) -> set[str]:
    text = FENCE.sub("", markdown_text(path))
    slugs: set[str] = set()
    for heading in HEADING.findall(text):
        slug, n = github_slug(heading), 1
        while slug in slugs:  # GitHub numbers repeated headings: x, x-1, x-2
            slug = f"{github_slug(heading)}-{n}"
            n += 1
        slugs.add(slug)
    return slugs


def links_in(path: Path) -> list[str]:
    text = INLINE_CODE.sub("", FENCE.sub("", markdown_text(path)))
    return INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)


def broken_links(path: Path) -> list[str]:
    problems = []
    for target in links_in(path):
        if EXTERNAL.match(target):
            continue
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            problems.append(f"{target} -> {resolved} does not exist")
        elif fragment and resolved.suffix in {".md", ".ipynb"} and fragment not in anchors_of(resolved):
            problems.append(f"{target}: no heading #{fragment} in {resolved.name}")
    return problems


def documents(repo_root: Path) -> list[Path]:
    found = [repo_root / "README.md"]
    for folder in ("docs", "deploy", "notebooks", "katib", "benchmarks"):
        found += sorted((repo_root / folder).rglob("*.md"))
    found += sorted((repo_root / "notebooks").glob("*.ipynb"))
    return [p for p in found if p.is_file() and ".ipynb_checkpoints" not in p.parts]


def test_every_relative_link_resolves(repo_root):
    docs = documents(repo_root)
    assert repo_root / "README.md" in docs and len(docs) >= 4
    problems = {str(p.relative_to(repo_root)): broken_links(p) for p in docs}
    problems = {k: v for k, v in problems.items() if v}
    assert not problems, "broken links:\n" + json.dumps(problems, indent=2)


def test_docs_index_links_every_doc(docs_dir):
    index = (docs_dir / "README.md").read_text()
    for doc in sorted(docs_dir.glob("*.md")):
        if doc.name != "README.md":
            assert f"({doc.name})" in index, f"docs/README.md does not link {doc.name}"


@pytest.mark.parametrize(
    ("markdown", "expected"),
    [
        ("see [x](missing.md)", ["missing.md"]),
        ("see [x](other.md#no-such-heading)", ["no-such-heading"]),
        ("see [x](#local-heading) and [y](other.md#real-one)", []),
        ("```\n[x](in-a-fence.md)\n```\nand `[y](in-code.md)`", []),
        ("[ref]: nowhere.md", ["nowhere.md"]),
        ("[web](https://example.com/x.md)", []),
    ],
)
def test_link_checker_catches_what_it_should(tmp_path, markdown, expected):
    (tmp_path / "other.md").write_text("# Real one\n")
    doc = tmp_path / "doc.md"
    doc.write_text("# Local heading\n\n" + markdown + "\n")
    problems = broken_links(doc)
    assert len(problems) == len(expected)
    for fragment, problem in zip(expected, problems, strict=True):
        assert fragment in problem


def test_github_slugs():
    assert github_slug("Pods stuck in `CreateContainerConfigError`") == "pods-stuck-in-createcontainerconfigerror"
    assert github_slug("NCCL hangs & timeouts (multi-node)") == "nccl-hangs--timeouts-multi-node"
    assert github_slug("1. Install: Training Operator v1 / Trainer v2") == "1-install-training-operator-v1--trainer-v2"

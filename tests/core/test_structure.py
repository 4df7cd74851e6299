"""A structure tool reads the same package arrows as docs/architecture.md (issue 26, item 1).

grimp (the graph behind import-linter) builds the import graph of ``llmft`` from the checkout,
module-level and function-local imports alike, following the committed ``llmft/<folder>`` links.
The package-level arrows it finds must be exactly the list in docs/architecture.md between the
``package-arrows`` markers: an import that adds an arrow (or the last one that removes one) fails
here until the document says so.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmft import SUBPACKAGES

grimp = pytest.importorskip("grimp")

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
PACKAGES = ("llmft.cli", "llmft.commands", *(f"llmft.{name}" for name in SUBPACKAGES))


def documented_arrows(text: str) -> set[tuple[str, str]]:
    """The ``importer -> imported, imported`` lines between the package-arrows markers."""
    block = re.search(r"<!-- package-arrows: begin -->(.*?)<!-- package-arrows: end -->", text, re.S)
    assert block, f"{DOC}: the package-arrows markers are missing"
    arrows = set()
    for line in block.group(1).splitlines():
        if "->" not in line:
            continue
        importer, imported = (part.strip() for part in line.split("->"))
        arrows |= {(importer, name.strip()) for name in imported.split(",")}
    return arrows


def tool_arrows() -> set[tuple[str, str]]:
    """Every (importer, imported) pair of our packages that grimp's graph holds."""
    graph = grimp.build_graph("llmft")
    return {
        (a, b)
        for a in PACKAGES
        for b in PACKAGES
        if a != b and graph.direct_import_exists(importer=a, imported=b, as_packages=True)
    }


def test_the_tool_sees_every_module_of_the_package():
    graph = grimp.build_graph("llmft")
    on_disk = {
        ".".join(("llmft", *path.relative_to(REPO).with_suffix("").parts)).removesuffix(".__init__")
        for name in SUBPACKAGES
        for path in (REPO / name).rglob("*.py")
    }
    assert on_disk <= graph.modules, sorted(on_disk - graph.modules)[:5]


def test_the_tool_draws_the_documented_arrows():
    documented = documented_arrows(DOC.read_text(encoding="utf-8"))
    drawn = tool_arrows()
    assert drawn == documented, (
        f"not in docs/architecture.md: {sorted(drawn - documented)}; "
        f"documented but not drawn: {sorted(documented - drawn)}"
    )


def test_the_arrow_reader_reads_a_block():
    text = "x\n<!-- package-arrows: begin -->\n```\na -> b, c\nd -> e\n```\n<!-- package-arrows: end -->\n"
    assert documented_arrows(text) == {("a", "b"), ("a", "c"), ("d", "e")}

"""The documentation stays true to the code and to itself: the generated flags table matches the
parser, README.md stays a short map that links every page of docs/, and no relative link is dead."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from crane_mp.docs_flags import render, split_page

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted((REPO / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_flags_page_is_generated_from_the_parser():
    _, generated, _ = split_page((REPO / "docs" / "flags.md").read_text())
    assert generated == render(), (
        "docs/flags.md is out of date with crane_mp/cli.py: regenerate it with "
        "`python -m crane_mp.docs_flags --write` from the repository root")


def test_readme_is_a_short_map_of_every_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "README.md is a map: move details into a page of docs/"
    linked = set(LINK.findall(readme))
    assert [p.name for p in PAGES if f"docs/{p.name}" not in linked] == []


def test_readme_shows_the_test_command_ci_runs():
    ci_command = next(line for line in (REPO / ".ci" / "run").read_text().splitlines() if "pytest -q" in line)
    assert ci_command in (REPO / "README.md").read_text()


@pytest.mark.parametrize("page", [REPO / "README.md", *PAGES], ids=lambda p: p.name)
def test_relative_links_name_existing_files(page):
    targets = [t.partition("#")[0] for t in LINK.findall(page.read_text())
               if not re.match(r"[a-z]+:", t)]
    assert [t for t in targets if t and not (page.parent / t).exists()] == []


def test_the_models_page_names_every_architecture():
    from crane_mp.models.registry import ARCHITECTURES, TRANSFORMERS

    page = (REPO / "docs" / "models.md").read_text()
    missing = [arch.hf_model_type for arch in ARCHITECTURES.values()
               if arch.name != TRANSFORMERS and f"`{arch.hf_model_type}`" not in page]
    assert missing == []

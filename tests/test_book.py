"""The book's source (docs/book.py) and its HTML (docs/book_html.py); the built book itself is
checked in a browser by tests/browser/test_book_in_browser.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))

import book  # noqa: E402
import book_html  # noqa: E402


def test_landing_page_is_the_readmes_own_sections():
    readme = (ROOT / "README.md").read_text()
    page = book.landing_page(readme)
    sections = book.readme_sections(readme)
    for name in ["", "Two commands", "On Colab", "On a TPU VM"]:
        assert sections[name] in page
    assert "**Who it is for:**" in page and "## Working on it" not in page


def test_every_section_the_landing_page_points_to_is_on_it():
    """The README's 'see "X" below' must hold on the landing page, which shows a few sections."""
    import re

    page = book.landing_page((ROOT / "README.md").read_text())
    headings = set(re.findall(r"^#+ (.+)$", page, flags=re.M))
    pointed = re.findall(r'see "([^"]+)" below', page)
    assert pointed, "the README's opening points to a section below; this test reads it"
    assert set(pointed) <= headings, f"not on the landing page: {set(pointed) - headings}"


def test_landing_page_names_a_missing_section():
    with pytest.raises(ValueError, match="On Colab"):
        book.landing_page("# Course\n\n## Two commands\n\n## On a TPU VM\n\n## The course\n")


def test_the_landing_page_links_each_notebook_by_its_name():
    page = book.link_notebook_names("| 01 | `01_heads` | `02_other` |", [Path("x/01_heads.ipynb")])
    assert page == "| 01 | [`01_heads`](notebooks/01_heads.ipynb) | `02_other` |"


def test_docstring_examples_and_indented_blocks_are_fenced():
    doc = "A sum.\n\n    a + b\n\nSo 2*h:\n\n>>> 1 + 1\n2\n\nThe end."
    assert book.docstring_markdown(doc) == (
        "A sum.\n\n```text\n    a + b\n```\n\nSo 2\\*h:\n\n```python\n>>> 1 + 1\n2\n```\n\nThe end."
    )


def test_prose_links_to_the_reference_and_to_notebooks_outside_code():
    prose = (
        "Use `make_batch` or `minilib.make_batch()`, as notebook 03 does.\n```\n`make_batch`\n```\n"
    )
    targets, notebooks = {"make_batch": "api-minilib-batch-make_batch"}, {"03": "./03_ragged.ipynb"}
    assert book.link_prose(prose, targets, notebooks) == (
        "Use [`make_batch`](#api-minilib-batch-make_batch) or "
        "[`minilib.make_batch()`](#api-minilib-batch-make_batch), as "
        "[notebook 03](./03_ragged.ipynb) does.\n```\n`make_batch`\n```\n"
    )


def test_an_explorer_becomes_its_figure_and_a_live_note():
    state = {
        "box": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_img"]}},
        "img": {"model_name": "ImageModel", "state": {},
                "buffers": [{"path": ["value"], "encoding": "base64", "data": "iVBORw0K"}]},
    }  # fmt: skip
    output = {"data": {book.WIDGET_VIEW: {"model_id": "box"}}}
    figure, note = book.static_explorer(output, state)
    assert figure["data"] == {"image/png": "iVBORw0K"}
    assert book.LIVE_NOTE in note["data"]["text/html"]


def test_a_reference_page_documents_each_public_name():
    import minilib.heads

    page = book.module_page("minilib.heads")
    for name in minilib.heads.__all__:
        assert f"({book.label('minilib.heads', name)})=\n### `{name}`" in page


def test_signatures_show_annotations_as_code():
    from minilib.heads import attention_kind

    assert (
        str(book.plain_signature(attention_kind)) == "(num_q_heads: int, num_kv_heads: int) -> str"
    )


def test_html_links_between_the_pages_files():
    assert book_html.href("/minilib-heads#api-x") == "minilib-heads.html#api-x"
    assert book_html.href("/page_table-1f2e.png") == "page_table-1f2e.png"
    assert book_html.href("https://example.org/a") == "https://example.org/a"
    link = {"type": "crossReference", "url": "/heads", "html_id": "api-h",
            "children": [{"type": "text", "value": "h < 2"}]}  # fmt: skip
    assert book_html.render(link) == '<a href="heads.html#api-h">h &lt; 2</a>'


def test_the_book_names_each_notebook_that_was_not_executed(tmp_path):
    (tmp_path / "00_setup_and_tour.ipynb").write_text("{}")
    with pytest.raises(ValueError, match="01_attention_and_head_grouping.ipynb"):
        book.write_book(tmp_path, tmp_path / "source")
    assert not (tmp_path / "source").exists()


def toc_files(entries: list[dict]) -> list[str]:
    files = []
    for entry in entries:
        files += [entry["file"]] if "file" in entry else toc_files(entry["children"])
    return files


def test_the_instructors_guide_is_a_page_of_the_book(tmp_path):
    """docs/instructors.md is in the table of contents, and each of its links reaches a page
    of the book (a notebook) or a label one defines (a checker's entry on an exercise page).
    The notebooks stand in for the executed ones: only their names matter here."""
    import json
    import re
    import shutil

    for path in (ROOT / "notebooks").glob(book.COURSE_GLOB):
        shutil.copy(path, tmp_path / path.name)
    source = tmp_path / "source"
    book.write_book(tmp_path, source)
    toc = json.loads((source / "myst.yml").read_text())["project"]["toc"]
    assert "instructors.md" in toc_files(toc)
    page = (source / "instructors.md").read_text()
    assert page.startswith("# Instructor's guide")
    labels = set()
    for exercises in (source / "exercises").glob("*.md"):
        labels |= set(re.findall(r"^\((api-[\w-]+)\)=$", exercises.read_text(), flags=re.M))
    anchors = re.findall(r"\]\(#(api-[\w-]+)\)", page)
    pages = re.findall(r"\]\((notebooks/[\w.]+)\)", page)
    assert "api-minilib-exercises-ex07_flash-check_flash_attention" in anchors
    assert set(anchors) <= labels, set(anchors) - labels
    assert "notebooks/08_tpu_kernel.ipynb" in pages
    assert all((source / p).is_file() for p in pages)

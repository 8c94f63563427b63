"""The explorers as a learner sees them: JupyterLab in headless Chromium, driven by Playwright.

Each test opens one notebook, runs it all (Run -> Run All Cells), then types into the
explorer's controls as a learner would and checks what the page shows. Every test also
checks that no cell raised, that no widget shows "Loading widget..." or its Python repr
instead of itself, and that the page logged no JavaScript error. Screenshots of each state
go to tests/browser/results/<environment>/.

    python3 tasks.py test                                # runs these as a step of its own
    .venv/bin/python -m pytest -m browser tests/browser  # or directly

Needs Debian's `chromium` and the `playwright` package (no browser download). To refresh
the README's screenshots (docs/img/) from this run, set MINILIB_DOCS_SCREENSHOTS=1.

To cover one more notebook, add a test like these: `open_notebook(name)` runs it and
returns the page; `nb.explorer(title)` finds an explorer by the start of its title.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.request
from pathlib import Path

import pytest
from jupyter_page import (
    LAB,
    ROOT,
    Chromium,
    JupyterLab,
    NotebookPage,
    chromium_path,
    front_end_for_this_environment,
)

pytestmark = pytest.mark.browser

RESULTS = Path(__file__).resolve().parent / "results"
DOCS_IMG = ROOT / "docs" / "img"
LOUD = "\n" + "!" * 78 + "\n{}\n" + "!" * 78


def environment_label() -> str:
    import ipywidgets

    return f"py{sys.version_info.major}{sys.version_info.minor}-ipywidgets{ipywidgets.__version__}"


@pytest.fixture(scope="module")
def results_dir() -> Path:
    path = RESULTS / environment_label()
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


@pytest.fixture(scope="module")
def lab(tmp_path_factory, results_dir):
    """JupyterLab on a copy of the notebooks (Run All must not write outputs into ours)."""
    notebooks = tmp_path_factory.mktemp("course") / "notebooks"
    shutil.copytree(ROOT / "notebooks", notebooks)
    with JupyterLab(notebooks, results_dir, front_end_for_this_environment()) as server:
        yield server


@pytest.fixture(scope="module")
def browser(results_dir, lab):
    missing = []
    if chromium_path() is None:
        missing.append("Debian's `chromium` is not installed (apt-get install chromium)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        missing.append("the `playwright` package is not installed (pip install playwright)")
    if missing:
        message = "BROWSER TEST SKIPPED: " + "; ".join(missing)
        print(LOUD.format(message), file=sys.stderr)
        pytest.skip(message)
    with Chromium(results_dir) as chromium:
        versions = {
            "python": sys.version.split()[0],
            "ipywidgets": environment_label().split("ipywidgets")[1],
            "front end": f"{lab.front_end.name} {lab.version}",
            "chromium": chromium.version,
        }
        (results_dir / "versions.json").write_text(json.dumps(versions, indent=1))
        print(f"\nbrowser test with {versions}")
        yield chromium


@pytest.fixture
def open_notebook(browser, lab, results_dir, record_property):
    """Open a notebook, Run All, check that it ran and rendered; after the test, check
    that the page logged no error and shut its kernel down."""
    opened = []

    def open_(name: str) -> NotebookPage:
        nb = NotebookPage(browser.new_page(), lab, name, results_dir)
        opened.append(nb)
        seconds = nb.run_all()
        record_property(f"{name} run all seconds", round(seconds, 1))
        print(f"{name}: Run All took {seconds:.1f} s")
        assert nb.cell_errors() == [], f"{name}: a cell raised:\n{nb.cell_errors()[0][:3000]}"
        assert nb.unrendered_widgets() == [], f"{name}: widgets did not render"
        return nb

    yield open_
    for nb in opened:
        nb.page.screenshot(path=results_dir / f"{Path(nb.name).stem}-page.png", full_page=False)
        assert nb.unrendered_widgets() == [], f"{nb.name}: widgets did not render"
        assert nb.page_errors == [], f"{nb.name}: JavaScript errors: {nb.page_errors}"
        assert nb.widget_console_errors() == [], f"{nb.name}: widget errors in the console"
        assert not nb.news_prompt_shown(), "the course's JupyterLab settings turn the news off"
        if nb.reaction_seconds:
            print(f"{nb.name}: reacted in at most {max(nb.reaction_seconds):.2f} s")
        errors = sorted({e.splitlines()[0][:200] for e in nb.console_errors})
        print(f"{nb.name}: console errors (reported, not failed): {errors}")
        nb.page.close()
    _shut_down_kernels(lab)


def _shut_down_kernels(lab: JupyterLab) -> None:
    headers = {"Authorization": f"token {lab.token}"}
    request = urllib.request.Request(f"{lab.url}/api/kernels", headers=headers)
    with urllib.request.urlopen(request) as response:
        kernels = json.load(response)
    for kernel in kernels:
        request = urllib.request.Request(
            f"{lab.url}/api/kernels/{kernel['id']}", method="DELETE", headers=headers
        )
        urllib.request.urlopen(request).close()


def screenshot(nb: NotebookPage, box, state: str, docs_name: str | None = None) -> None:
    """Save the explorer as it is now; with MINILIB_DOCS_SCREENSHOTS=1, also a small copy
    for the README."""
    path = nb.screenshot(box, state)
    if docs_name and nb.front_end == LAB and os.environ.get("MINILIB_DOCS_SCREENSHOTS") == "1":
        shrink_for_docs(path, DOCS_IMG / f"{docs_name}.png")


def shrink_for_docs(
    source: Path, target: Path, width: int = 640, colours: int = 96, top: int = 1000
) -> None:
    """A copy small enough to commit: its `top` pixels, `width` wide, `colours` colours."""
    from PIL import Image

    target.parent.mkdir(parents=True, exist_ok=True)
    image = Image.open(source).convert("RGB")
    image = image.crop((0, 0, image.width, min(image.height, top)))
    height = round(image.height * width / image.width)
    small = image.resize((width, height), Image.LANCZOS)
    small.quantize(colors=colours, method=Image.Quantize.MEDIANCUT).save(target, optimize=True)


def wraps_between_words(nb: NotebookPage, box) -> bool:
    """Every <pre> in the explorer has word-break: normal (not the front end's break-all)."""
    styles = box.locator("pre").evaluate_all("pres => pres.map(p => getComputedStyle(p).wordBreak)")
    return bool(styles) and all(s == "normal" for s in styles)


def message_colour(box) -> str:
    """The colour of the status box's left border: green for all clear, else a problem."""
    return box.locator(".widget-html-content > div[style*='border-left']").first.evaluate(
        "d => getComputedStyle(d).borderLeftColor"
    )


GREEN, VERMILLION = (
    "rgb(0, 158, 115)",
    "rgb(213, 94, 0)",
)  # Okabe-Ito, as in minilib.explore.explorer (OK_COLOUR, PROBLEM_COLOUR)


# --- the notebooks -------------------------------------------------------------------------


def test_01_head_grouping(open_notebook):
    nb = open_notebook("01_attention_and_head_grouping.ipynb")
    box = nb.explorer("Head grouping")
    nb.wait_for_text(box, "each of the 4 KV heads serves 3 q heads")
    first = nb.wait_for_figure(box)
    assert message_colour(box) == GREEN
    screenshot(nb, box, "01-head-grouping-12-4")

    nb.type_into(box, "num_kv_heads", "8")  # the famous pair: 12 and 8
    nb.wait_for_text(box, "num_q_heads=12 must be divisible by num_kv_heads=8")
    assert "Hint: each KV head must serve the same number of q heads" in box.inner_text()
    assert "(nearest to 8: 6)" in box.inner_text()
    assert nb.figure_bytes(box) == "" and message_colour(box) == VERMILLION
    assert wraps_between_words(nb, box)
    screenshot(nb, box, "01-head-grouping-12-8-error", "head_grouping_error")

    nb.type_into(box, "num_kv_heads", "6")  # the hint's nearest valid count
    nb.wait_for_text(box, "must be divisible", present=False)
    nb.wait_for_text(box, "each of the 6 KV heads serves 2 q heads")
    nb.wait_for_figure(box, other_than=first)
    assert "Hint:" not in box.inner_text() and message_colour(box) == GREEN
    screenshot(nb, box, "01-head-grouping-12-6")


def test_02_page_table(open_notebook):
    nb = open_notebook("02_paged_kv_cache.ipynb")
    box = nb.explorer("The paged KV cache")
    nb.wait_for_text(box, "3 sequences: 162 tokens in 12 pages of 16 slots")
    before = nb.wait_for_figure(box)
    screenshot(nb, box, "02-page-table-16", "page_table")

    nb.type_into(box, "page_size", "64")
    nb.wait_for_text(box, "in 4 pages of 64 slots")
    nb.wait_for_figure(box, other_than=before)
    screenshot(nb, box, "02-page-table-64")

    nb.type_into(box, "page_size", "1")  # needs 162 pages: the note says to raise the pool
    nb.wait_for_text(box, "Out of pages")
    assert "set total_num_pages to 162" in box.inner_text()
    assert "free(" not in box.inner_text() and nb.figure_bytes(box) == ""
    assert wraps_between_words(nb, box)
    screenshot(nb, box, "02-page-table-1-out-of-pages")
    nb.type_into(box, "total_num_pages", "162")  # the hint's fix works
    nb.wait_for_text(box, "in 162 pages of 1 slot;")
    nb.wait_for_figure(box, other_than=before)
    screenshot(nb, box, "02-page-table-1-in-162-pages")


def test_05_validation_playground(open_notebook):
    nb = open_notebook("05_validation.ipynb")
    box = nb.explorer("Validation playground")
    nb.wait_for_text(box, "num_q_heads=12 must be divisible by num_kv_heads=8")
    assert message_colour(box) == VERMILLION  # an error is never shown in the green box
    screenshot(nb, box, "05-playground-12-8")

    nb.choose(box, "mistake", "kv_lens as int64 (NumPy's default)")
    nb.wait_for_text(box, "kv_lens.dtype=dtype('int64')")
    nb.wait_for_text(box, "def int64_lengths(b):")
    assert "Hint:" in box.inner_text() and message_colour(box) == VERMILLION
    assert wraps_between_words(nb, box)
    screenshot(nb, box, "05-playground-int64", "validation_playground")

    nb.choose(box, "mistake", "a page index out of range")
    nb.wait_for_text(box, "page_indices[1, 0]=9 is outside [0, 9)")
    assert "kv_lens.dtype" not in box.inner_text()
    screenshot(nb, box, "05-playground-page-index")

    nb.choose(box, "mistake", "correct: a valid mixed batch")
    nb.wait_for_text(box, "Valid: dynamic_validate_inputs accepts these inputs.")
    assert message_colour(box) == GREEN


def test_08_kernel_schedule(open_notebook):
    nb = open_notebook("08_tpu_kernel.ipynb")
    box = nb.explorer("The kernel's schedule")
    nb.wait_for_text(box, "grid = (2 heads blocks, 3 q blocks) = 6 grid steps")
    before = nb.wait_for_figure(box)
    screenshot(nb, box, "08-schedule-default", "kernel_schedule")

    nb.type_into(box, "num_queries_per_block", "16", submit=True)
    nb.wait_for_text(box, "grid = (2 heads blocks, 2 q blocks) = 4 grid steps")
    after = nb.wait_for_figure(box, other_than=before)
    screenshot(nb, box, "08-schedule-16-queries-per-block")

    nb.type_into(box, "num_kv_heads", "6")  # 16 q heads over 6 KV heads: not allowed
    nb.wait_for_text(box, "num_q_heads=16 must be divisible by num_kv_heads=6")
    nb.type_into(box, "num_kv_heads", "2")
    nb.wait_for_text(box, "must be divisible", present=False)
    nb.wait_for_text(box, "grid = (1 heads block, 2 q blocks) = 2 grid steps")
    nb.wait_for_figure(box, other_than=after)
    screenshot(nb, box, "08-schedule-2-kv-heads")

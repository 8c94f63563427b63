"""The course's book (`python3 tasks.py book`, build/book/html) in headless Chromium.

Every page loads without a JavaScript or console error, every internal link reaches a page
(and its anchor) of the book, every image loads, and notebook 01's page shows the
head-grouping error in a cell's output. Screenshots of the landing page and notebook 01's go to
tests/browser/results/book/.

    python3 tasks.py book
    .venv/bin/python -m pytest -m browser tests/browser/test_book_in_browser.py

The site is served by Python's http.server on a free port of 127.0.0.1.
"""

from __future__ import annotations

import functools
import http.server
import re
import shutil
import sys
import threading
import urllib.parse
from pathlib import Path

import pytest
from jupyter_page import ROOT, Chromium, chromium_path

pytestmark = pytest.mark.browser

BOOK_HTML = ROOT / "build" / "book" / "html"
RESULTS = Path(__file__).resolve().parent / "results" / "book"
HEAD_GROUPING_ERROR = "num_q_heads=12 must be divisible by num_kv_heads=8"
LOUD = "\n" + "!" * 78 + "\n{}\n" + "!" * 78


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def site():
    """The book's base URL, served from BOOK_HTML."""
    if not (BOOK_HTML / "index.html").exists():
        message = f"BOOK BROWSER TEST SKIPPED: no book in {BOOK_HTML} (python3 tasks.py book)"
        print(LOUD.format(message), file=sys.stderr)
        pytest.skip(message)
    handler = functools.partial(QuietHandler, directory=str(BOOK_HTML))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    if chromium_path() is None:
        message = "BOOK BROWSER TEST SKIPPED: Debian's `chromium` is not installed"
        print(LOUD.format(message), file=sys.stderr)
        pytest.skip(message)
    shutil.rmtree(RESULTS, ignore_errors=True)
    RESULTS.mkdir(parents=True)
    with Chromium(RESULTS) as chromium:
        yield chromium


def visit(browser, url: str) -> dict:
    """Open `url`; what it shows: its errors, links, ids, text and broken images."""
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda err: errors.append(f"page error: {err}"))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("requestfailed", lambda req: errors.append(f"request failed: {req.url}"))
    page.on(
        "response",
        lambda r: errors.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None,
    )
    response = page.goto(url, wait_until="load")
    if response is None or not response.ok:
        errors.append(f"{url}: HTTP {response.status if response else 'no response'}")
    seen = page.evaluate(
        """() => ({
            links: [...document.querySelectorAll('a[href]')].map(a => a.href),
            ids: [...document.querySelectorAll('[id]')].map(e => e.id),
            text: document.body.innerText,
            broken_images: [...document.images]
                .filter(img => !img.complete || img.naturalWidth === 0).map(img => img.src),
        })"""
    )
    page.close()
    return {**seen, "errors": errors}


def test_every_page_loads_and_every_link_and_image_resolves(site, browser):
    pages = {}
    todo = [urllib.parse.urljoin(site, "index.html")]
    while todo:  # every page reached from the landing page
        url = todo.pop()
        if url in pages:
            continue
        pages[url] = visit(browser, url)
        for link in pages[url]["links"]:
            target = link.split("#")[0]
            if target.startswith(site) and target.endswith(".html") and target not in pages:
                todo.append(target)
    built = {urllib.parse.urljoin(site, p.name) for p in BOOK_HTML.glob("*.html")}
    assert built <= set(pages), f"pages no link reaches: {sorted(built - set(pages))}"

    problems = []
    for url, seen in pages.items():
        problems += [f"{url}: {error}" for error in seen["errors"]]
        problems += [f"{url}: broken image {src}" for src in seen["broken_images"]]
        for link in seen["links"]:
            target, _, anchor = link.partition("#")
            if not target.startswith(site):
                continue  # another site: not the book's to check
            if target not in pages:
                problems.append(f"{url}: link to a missing page {link}")
            elif anchor and urllib.parse.unquote(anchor) not in pages[target]["ids"]:
                problems.append(f"{url}: link to a missing anchor {link}")
    assert not problems, "\n".join(problems[:30])
    print(f"\nThe book: {len(pages)} pages, each loaded without an error; links and images ok.")


def notebook_page(site, browser, number: str) -> str:
    """The URL of notebook `number`'s page, found by its title in the landing page's menu."""
    page = browser.new_page()
    page.goto(urllib.parse.urljoin(site, "index.html"))
    link = page.locator("nav a", has_text=f"{number} ·").first
    url = urllib.parse.urljoin(site, link.get_attribute("href"))
    page.close()
    return url


def test_notebook_01_shows_the_head_grouping_error_in_an_output(site, browser):
    """In a cell's output, as the notebook printed it (its prose names the error too)."""
    page = browser.new_page()
    page.goto(notebook_page(site, browser, "01"))
    assert page.locator(".output", has_text=HEAD_GROUPING_ERROR).count() >= 1
    page.close()


def test_notebook_01_links_to_notebooks_and_the_reference_and_shows_its_explorer(site, browser):
    """Its prose links another notebook and a minilib function's entry (whose anchors the
    first test checks); its explorer is a figure with the line saying it is live."""
    page = browser.new_page()
    page.goto(notebook_page(site, browser, "01"))
    links = page.eval_on_selector_all("main a[href]", "as => as.map(a => a.getAttribute('href'))")
    notebooks = [a.get_attribute("href") for a in page.locator("nav a").all()
                 if re.match(r"\d\d ·", a.inner_text())]  # fmt: skip
    assert any("#api-minilib" in link for link in links), links
    assert any(link.split("#")[0] in notebooks for link in links), (links, notebooks)
    live = page.locator(".output", has_text="A static figure of the explorer")
    assert live.count() >= 1
    assert page.locator("img.output").count() >= 1
    page.close()


def test_screenshots_of_two_pages(site, browser):
    page = browser.new_page()
    page.set_viewport_size({"width": 1280, "height": 1000})
    page.goto(urllib.parse.urljoin(site, "index.html"))
    page.screenshot(path=RESULTS / "landing_page.png")
    page.goto(notebook_page(site, browser, "01"))
    page.locator(".output", has_text=HEAD_GROUPING_ERROR).first.scroll_into_view_if_needed()
    page.screenshot(path=RESULTS / "01_head_grouping_error.png")
    page.close()
    for name in ("landing_page.png", "01_head_grouping_error.png"):
        assert (RESULTS / name).stat().st_size > 10_000, f"{name} looks empty"
    print(f"\nScreenshots of the book: {RESULTS}")

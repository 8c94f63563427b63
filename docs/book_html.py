"""The book as static HTML, from the content that `jupyter book build --site` writes.

    python docs/book_html.py SITE HTML   # SITE: the book's _build/site; tasks.py book runs it

Jupyter Book 2 parses the pages and notebooks, resolves every cross-reference and extracts the
outputs' images into SITE (config.json, content/<slug>.json: each page's MyST tree, public/:
images). Its themes are downloaded from the web at build time, which CI cannot do, so this
renders those trees itself: one HTML file per page, with the table of contents beside it.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import sys
from pathlib import Path

STYLE = (Path(__file__).parent / "book_template" / "style.css").read_text()
ANSI = re.compile(r"\x1b\[[0-9;]*m")
TAGS = {"paragraph": "p", "strong": "strong", "emphasis": "em", "blockquote": "blockquote",
        "listItem": "li", "tableRow": "tr", "subscript": "sub", "superscript": "sup",
        "delete": "del", "caption": "figcaption", "container": "figure"}  # fmt: skip
# An output's formats, the first the page can show.
OUTPUT_FORMATS = ["image/png", "image/svg+xml", "text/html", "text/markdown", "text/plain"]


def href(url: str) -> str:
    """A MyST url ("/slug", "/slug#id", "/image.png") as a link between the HTML files."""
    if url.startswith("/"):
        path, _, anchor = url[1:].partition("#")
        if path and "." not in path:
            path += ".html"
        return path + (f"#{anchor}" if anchor else "")
    return url


def children(node: dict) -> str:
    return "".join(render(child) for child in node.get("children", []))


def render(node: dict) -> str:
    kind, text = node["type"], html.escape(node.get("value", ""))
    anchor = f' id="{node["html_id"]}"' if "html_id" in node else ""
    if kind == "text":
        return text
    if kind in TAGS:
        return f"<{TAGS[kind]}{anchor}>{children(node)}</{TAGS[kind]}>"
    if kind == "heading":
        return f"<h{node['depth']}{anchor}>{children(node)}</h{node['depth']}>"
    if kind in ("inlineCode", "inlineMath"):
        return f"<code>{text}</code>"
    if kind in ("code", "math"):
        return f'<pre class="{kind}"><code>{text}</code></pre>'
    if kind == "list":
        tag = "ol" if node.get("ordered") else "ul"
        return f"<{tag}>{children(node)}</{tag}>"
    if kind in ("link", "crossReference"):
        url = node.get("url", "") + (f"#{node['html_id']}" if kind == "crossReference" else "")
        return f'<a href="{html.escape(href(url))}">{children(node)}</a>'
    if kind == "image":
        alt = html.escape(node.get("alt", ""))
        return f'<img src="{html.escape(href(node["url"]))}" alt="{alt}">'
    if kind == "table":
        return f"<table>{children(node)}</table>"
    if kind == "tableCell":
        tag = "th" if node.get("header") else "td"
        return f"<{tag}>{children(node)}</{tag}>"
    if kind == "thematicBreak":
        return "<hr>"
    if kind == "break":
        return "<br>"
    if kind == "html":
        return node["value"]
    if kind == "mystTarget":
        return f'<span id="{node.get("html_id", node["label"])}"></span>'
    if kind == "output":
        return output(node)
    if kind in ("comment", "footnoteDefinition"):
        return ""
    return f"<div{anchor}>{children(node)}</div>"  # block, outputs, admonition, ...


def output(node: dict) -> str:
    """A notebook output: a stream, an error's traceback, or its best format."""
    data = node.get("jupyter_data", {})
    if data.get("output_type") == "stream":
        return f'<pre class="output">{html.escape(data["text"])}</pre>'
    if data.get("output_type") == "error":
        trace = ANSI.sub("", "\n".join(data.get("traceback", [])))
        return f'<pre class="output error">{html.escape(trace)}</pre>'
    if node.get("children"):  # text/markdown, parsed by MyST
        return f'<div class="output">{children(node)}</div>'
    formats = data.get("data", {})
    kind = next((k for k in OUTPUT_FORMATS if k in formats), None)
    if kind is None:
        return ""
    value = formats[kind]
    if kind.startswith("image/"):
        return f'<img class="output" src="{html.escape(href(value["path"]))}" alt="a figure">'
    content = value.get("content", "")
    if kind == "text/html":
        return f'<div class="output">{content}</div>'
    return f'<pre class="output">{html.escape(content)}</pre>'


def navigation(pages: list[dict], current: str) -> str:
    items = ['<p><a href="index.html">Home</a></p>']
    for page in pages:
        title = html.escape(page["title"])
        if "slug" not in page:
            items.append(f"<h3>{title}</h3>")
        else:
            mark = ' class="current"' if page["slug"] == current else ""
            items.append(f'<p><a{mark} href="{page["slug"]}.html">{title}</a></p>')
    return "\n".join(items)


def page_html(content: dict, nav: str, site_title: str) -> str:
    title = html.escape(content["frontmatter"].get("title", ""))
    heading = f"<h1>{title}</h1>" if title else ""
    tab = title if title == html.escape(site_title) else f"{title} · {html.escape(site_title)}"
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<link rel="icon" href="data:,">'
        f"<title>{tab}</title><style>{STYLE}</style></head>"
        f"<body><nav>{nav}</nav><main>{heading}{render(content['mdast'])}</main></body></html>\n"
    )


def write_html(site: Path, out: Path) -> list[str]:
    """Writes each page of the book in `site` to `out`/<slug>.html; returns the slugs."""
    project = json.loads((site / "config.json").read_text())["projects"][0]
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(site / "public", out)
    slugs = [project["index"]] + [p["slug"] for p in project["pages"] if "slug" in p]
    for slug in slugs:
        content = json.loads((site / "content" / f"{slug}.json").read_text())
        nav = navigation(project["pages"], slug)
        (out / f"{slug}.html").write_text(page_html(content, nav, project["title"]))
    return slugs


if __name__ == "__main__":
    write_html(Path(sys.argv[1]), Path(sys.argv[2]))

"""`EngineView`: a live ipywidgets view of an `Engine`, step by step.

Four panels, redrawn after every step:

    counters     step, prefill and decode tokens, pages in use, waiting, running, preempted,
                 and the prompt tokens found in the prefix cache
    pages        the page pool, one cell per page, coloured by the requests that hold it: a
                 page two requests share (a prefix cache hit) has both colours; a cached
                 full page has a heavy border, and a free page still cached is marked "c"
    page tables  each running request's row of `page_indices`: shared pages, and so two
                 sequences pointing at one page, show side by side
    batch        the step's ragged batch: one segment per sequence, as wide as its tokens,
                 striped for a prefill chunk, solid for a decode token

Everything is HTML in `HTML` widgets (no images, no front-end extension), so it renders as
real widgets in Jupyter and Colab with ipywidgets 7 or 8, and its text can be read without a
browser. After a run, the slider replays any recorded step.

    >>> from minilib.engine import TINY_CONFIG as config, Engine, init_params
    >>> from minilib import ragged_paged_attention_jnp
    >>> engine = Engine(init_params(config), config, num_pages=6, page_size=4,
    ...                 max_num_batched_tokens=8, max_num_seqs=2,
    ...                 attention=ragged_paged_attention_jnp)
    >>> view = EngineView(engine)
    >>> _ = engine.add_request([1, 2, 3, 4, 5], max_new_tokens=2)
    >>> view.run()
    >>> "step 1 of 2" in view.text, "pages in use: 0 of 6" in view.text
    (True, True)
"""

from __future__ import annotations

import html
import re
import time

import ipywidgets as widgets

from minilib.engine.engine import Engine
from minilib.engine.outputs import StepStats
from minilib.explore.style import LIGHT_GREY, color

__all__ = ["EngineView"]

CELL = "display:inline-block;box-sizing:border-box;text-align:center;font:11px monospace;"


class EngineView(widgets.VBox):
    """A live view of `engine`: call `view.run()` (or `view.show(engine.step())`).

    >>> from minilib import ragged_paged_attention_jnp
    >>> from minilib.engine import TINY_CONFIG as config, init_params
    >>> engine = Engine(init_params(config), config, num_pages=6, page_size=4,
    ...                 max_num_batched_tokens=8, max_num_seqs=2,
    ...                 attention=ragged_paged_attention_jnp)
    >>> view = EngineView(engine, title="one request")
    >>> _ = engine.add_request([1, 2, 3], max_new_tokens=1)
    >>> view.show(engine.step())
    >>> print(view.text.splitlines()[0])
    step 0 of 1: 3 prefill + 0 decode tokens (budget 8); pages in use: 0 of 6; waiting: 0;
    running: 0; preempted: none; finished: r0
    """

    def __init__(self, engine: Engine, title: str = "Engine"):
        self.engine = engine
        self.counters, self.pages, self.batch = widgets.HTML(), widgets.HTML(), widgets.HTML()
        self.tables = widgets.HTML()
        self.slider = widgets.IntSlider(
            value=0, min=0, max=0, description="step", continuous_update=True, disabled=True
        )
        self.slider.observe(self._on_slide, names="value")
        header = widgets.HTML(f"<b style='font-size:1.1em'>{html.escape(title)}</b>")
        panels = [header, self.counters, self.pages, self.tables, self.batch, self.slider]
        super().__init__(panels)
        self._showing_live = False
        self.counters.value = _counters_html(None, engine)
        self.pages.value = _pages_html(engine.scheduler.page_owners, ())

    def run(self, max_steps: int | None = None, delay: float = 0.0) -> None:
        """Step the engine until every request is done (or `max_steps`), redrawing after each
        step; `delay` seconds between steps make it watchable."""
        steps = 0
        while self.engine.has_unfinished and (max_steps is None or steps < max_steps):
            self.show(self.engine.step())
            steps += 1
            if delay:
                time.sleep(delay)

    def show(self, stats: StepStats) -> None:
        """Draw `stats`, and let the slider reach every step recorded so far (the engine
        keeps the last `engine.max_stats`)."""
        self.counters.value = _counters_html(stats, self.engine)
        self.pages.value = _pages_html(stats.page_owners, stats.cached_pages)
        self.tables.value = _page_tables_html(stats)
        self.batch.value = _batch_html(stats, self.engine.max_num_batched_tokens)
        self._showing_live = True  # the slider moves with the run without redrawing twice
        recorded = self.engine.stats
        self.slider.max = recorded[-1].step
        self.slider.min = recorded[0].step
        self.slider.value = stats.step
        self.slider.disabled = False
        self._showing_live = False

    @property
    def text(self) -> str:
        """What the panels say, without markup."""
        parts = [self.counters.value, self.pages.value, self.tables.value, self.batch.value]
        text = re.sub(r"<br>|</div>", "\n", "\n".join(parts))
        return html.unescape(re.sub(r"<[^>]+>", "", text))

    def _on_slide(self, change) -> None:
        recorded = self.engine.stats
        index = change["new"] - recorded[0].step if recorded else -1  # step -> place in stats
        if not self._showing_live and 0 <= index < len(recorded):
            self.show(recorded[index])


def _counters_html(stats: StepStats | None, engine: Engine) -> str:
    if stats is None:
        return "<div>no step yet</div>"
    preempted = ", ".join(f"r{i}" for i in stats.preempted) or "none"
    finished = ", ".join(f"r{i}" for i in stats.finished) or "none"
    cached = ""
    if engine.scheduler.enable_prefix_caching:
        cached = f"; prompt tokens from the prefix cache: {stats.num_cached_tokens}"
    return (
        f"<div><b>step {stats.step} of {engine.num_steps}</b>: "
        f"{stats.num_prefill_tokens} prefill + {stats.num_decode_tokens} decode tokens "
        f"(budget {engine.max_num_batched_tokens}); "
        f"pages in use: {stats.num_pages_used} of {engine.num_pages}; "
        f"waiting: {stats.num_waiting}; running: {stats.num_running}; "
        f"preempted: {preempted}; finished: {finished}"
        f"{cached}</div>"
    )


def _fill(owners) -> str:
    """One colour per owner, side by side: a shared page shows every request holding it."""
    if not owners:
        return LIGHT_GREY
    if len(owners) == 1:
        return color(owners[0])
    width = 100 / len(owners)
    stops = ",".join(
        f"{color(o)} {i * width:.1f}% {(i + 1) * width:.1f}%" for i, o in enumerate(owners)
    )
    return f"linear-gradient(90deg,{stops})"


def _page_cell(page: int, owners, cached: bool, label: str) -> str:
    border = "border:2px solid #000;" if cached else "border:2px solid transparent;"
    state = "shared by " if len(owners) > 1 else "held by " if owners else "free"
    who = " and ".join(f"r{o}" for o in owners)
    note = ", cached" if cached else ""
    width = max(30, 8 * len(label) + 6)
    return (
        f"<div title='page {page}: {state}{who}{note}' style='{CELL}{border}width:{width}px;"
        f"height:24px;line-height:20px;margin:1px;background:{_fill(owners)}'>{label}</div>"
    )


def _pages_html(owners, cached_pages) -> str:
    cached = set(cached_pages)
    cells = []
    for page, holders in enumerate(owners):
        if holders:
            label = "+".join(f"r{o}" for o in holders)
        else:
            label = "c" if page in cached else "·"
        cells.append(_page_cell(page, holders, page in cached, label))
    legend = (
        "page pool (· free; c free but still cached; heavy border: a cached full page; "
        "several colours: one page that several requests hold)"
    )
    return f"<div>{legend}</div><div style='max-width:720px'>{''.join(cells)}</div>"


def _page_tables_html(stats: StepStats) -> str:
    if not stats.page_tables:
        return "<div>page tables: no request running</div>"
    cached = set(stats.cached_pages)
    rows = []
    for request_id, pages in stats.page_tables:
        cells = "".join(
            _page_cell(page, stats.page_owners[page], page in cached, str(page)) for page in pages
        )
        rows.append(f"<div>r{request_id}: {cells}</div>")
    return "<div>page tables (each request's pages, in token order)</div>" + "".join(rows)


def _batch_html(stats: StepStats, budget: int) -> str:
    segments = []
    for request_id, kind, num_tokens in stats.batch:
        fill = color(request_id)
        if kind == "prefill":  # stripes: a chunk of a prompt (or a recompute)
            fill = f"repeating-linear-gradient(45deg,{fill} 0 6px,#ffffff 6px 9px)"
        width = 100 * num_tokens / budget
        segments.append(
            f"<div title='r{request_id} {kind} {num_tokens}' style='{CELL}"
            f"width:{width:.2f}%;height:22px;line-height:22px;background:{fill};"
            f"border-right:1px solid #333'>r{request_id} {kind[0]}{num_tokens}"
            "</div>"
        )
    legend = "batch: r&lt;id&gt; p&lt;n&gt; = prefill chunk of n (striped), d1 = decode"
    bar = (
        f"<div style='width:720px;border:1px solid #333;background:#fff;"
        f"white-space:nowrap;overflow:hidden'>{''.join(segments)}</div>"
    )
    return f"<div>{legend}</div>{bar}"

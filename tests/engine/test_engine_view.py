"""minilib.engine.view: the engine's live view."""

from __future__ import annotations

from engine_runs import MAX_NEW, PAGE, PROMPTS, checked_step, engine, shared_prefix_prompts


def test_live_view_is_real_widgets_and_replays_every_step():
    import ipywidgets as widgets

    from minilib.engine.view import EngineView

    eng = engine(num_pages=10)
    view = EngineView(eng, "test")
    assert isinstance(view, widgets.VBox)
    assert all(isinstance(c, widgets.HTML | widgets.IntSlider) for c in view.children)
    for prompt in PROMPTS:
        eng.add_request(prompt, MAX_NEW)
    view.run(max_steps=1)
    assert len(eng.stats) == 1 and "step 0 of 1" in view.text
    view.run()
    n = len(eng.stats)
    assert not eng.has_unfinished
    assert (view.slider.max, view.slider.value) == (n - 1, n - 1)
    assert (
        f"step {n - 1} of {n}" in view.text and f"pages in use: 0 of {eng.num_pages}" in view.text
    )
    first = next(s for s in eng.stats if s.preempted)
    view.slider.value = first.step  # replay: the panels show that step again
    assert f"step {first.step} of {n}" in view.text
    assert f"preempted: r{first.preempted[0]}" in view.text
    assert view.pages.value.count("title='page ") == eng.num_pages
    for owner in {o for owners in first.page_owners for o in owners}:
        assert f">r{owner}</div>" in view.pages.value
    for request_id, kind, num_tokens in first.batch:
        assert f"r{request_id} {kind[0]}{num_tokens}" in view.text


def test_live_view_replays_the_steps_the_engine_kept():
    from minilib.engine.view import EngineView

    eng = engine(max_stats=4)
    view = EngineView(eng, "the last 4 steps")
    eng.add_request(PROMPTS[1], MAX_NEW)
    view.run()
    n = eng.num_steps
    assert n > 4 and (view.slider.min, view.slider.max, view.slider.value) == (n - 4, n - 1, n - 1)
    view.slider.value = n - 4  # the oldest step kept
    assert f"step {n - 4} of {n}" in view.text


def test_live_view_shows_shared_pages_and_page_tables():
    from minilib.engine.view import EngineView

    prompts, _ = shared_prefix_prompts()
    eng = engine(page_size=PAGE, enable_prefix_caching=True)
    view = EngineView(eng, "prefix caching")
    eng.add_request(prompts[0], 3)
    view.show(checked_step(eng))
    for p in prompts[1:4]:
        eng.add_request(p, 3)
    view.run()
    shared = next(s for s in eng.stats if s.shared_pages)
    view.slider.value = shared.step
    page = shared.shared_pages[0]
    holders = "+".join(f"r{o}" for o in shared.page_owners[page])
    assert f"title='page {page}: shared by " in view.pages.value
    assert f">{holders}</div>" in view.pages.value
    for request_id, pages in shared.page_tables:  # every request's row of page_indices
        assert f"r{request_id}: " in view.text
        assert all(f"title='page {p}:" in view.tables.value for p in pages)
    assert f"prompt tokens from the prefix cache: {shared.num_cached_tokens}" in view.text
    view.slider.value = len(eng.stats) - 1  # at the end: every page free, the full ones cached
    assert view.pages.value.count(">c</div>") == len(eng.stats[-1].cached_pages) > 0

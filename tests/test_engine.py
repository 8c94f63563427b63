"""minilib.engine: the engine's greedy tokens equal `dense_generate`'s, token for token.

Exactness is checked for a mix of prompt lengths, chunked prefill (prompts longer than the
step's token budget), a pool small enough to force waiting and preemption, and every attention
implementation (the Pallas kernel in TPU interpret mode, on tiny shapes). The engine's pool
starts as NaN, so a read of any slot no token was written to would show.

Tolerance policy. In float32 the tokens must be equal, with no tolerance: the model's logits
have a spread of about 4, and the smallest top-two gap in these runs is orders of magnitude
above float32 rounding. In bfloat16 the engine and the dense model round differently (other
summation orders, about 3 significant digits), so where the dense model's top two logits are
closer than `BF16_MARGIN` a greedy token may legitimately flip, and from there the two
sequences continue from different text. So in bfloat16 each request's tokens must be equal up
to its first token chosen by a gap below `BF16_MARGIN`; after it they are not compared. The
compared prefixes must cover at least half of all tokens, so the check cannot pass vacuously.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import minilib
from minilib.engine import Engine, EngineError, ModelConfig, dense_generate, init_params
from minilib.engine.model import dense_generate_with_margins

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ModelConfig(vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32)
PARAMS = init_params(CONFIG, seed=0)
# Prompt lengths from 1 to 30: several are longer than the budget of 16 tokens (chunked).
PROMPTS = [np.random.default_rng(1).integers(0, 64, n).tolist() for n in (3, 17, 9, 30, 1, 12)]
MAX_NEW = 8
BF16_MARGIN = 0.25  # logits; bf16 rounding moves them by a few hundredths here

IMPLEMENTATIONS = {
    "jnp": minilib.ragged_paged_attention_jnp,
    "blockwise": minilib.ragged_paged_attention_blockwise,
}


@pytest.fixture(scope="module")
def dense_tokens():
    return [dense_generate(PARAMS, CONFIG, p, MAX_NEW) for p in PROMPTS]


def engine(attention=minilib.ragged_paged_attention_jnp, params=PARAMS, config=CONFIG, **kw):
    sizes = {"num_pages": 32, "page_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 4}
    return Engine(params, config, attention=attention, **(sizes | kw))


def assert_all_pages_free(eng: Engine):
    allocator = eng.scheduler.allocator
    assert allocator.num_free == eng.num_pages and allocator.num_used == 0
    assert not eng.has_unfinished


# --- exactness -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_mixed_lengths_and_chunked_prefill_match_dense(name, dense_tokens):
    eng = engine(IMPLEMENTATIONS[name])
    assert eng.generate(PROMPTS, MAX_NEW) == dense_tokens
    longest = max(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))
    assert len(PROMPTS[longest]) > eng.max_num_batched_tokens
    chunks = [n for s in eng.stats for i, kind, n in s.batch if i == longest and kind == "prefill"]
    assert len(chunks) >= 2 and sum(chunks) == len(PROMPTS[longest]), "no chunked prefill"
    mixed = [s for s in eng.stats if s.num_prefill_tokens and s.num_decode_tokens]
    assert mixed, "the run should mix prefill chunks and decodes in one step"
    assert all(s.num_tokens <= eng.max_num_batched_tokens for s in eng.stats)
    assert all(len(s.batch) <= eng.max_num_seqs for s in eng.stats)
    assert_all_pages_free(eng)


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_small_pool_waits_and_preempts_without_changing_outputs(name, dense_tokens):
    eng = engine(IMPLEMENTATIONS[name], num_pages=10)
    assert eng.generate(PROMPTS, MAX_NEW) == dense_tokens
    assert any(s.num_waiting for s in eng.stats), "no request ever waited"
    assert sum(s.num_preempted for s in eng.stats) > 0, "no request was preempted"
    assert max(s.num_pages_used for s in eng.stats) <= 10
    assert_all_pages_free(eng)


def test_reference_attention_matches_dense(dense_tokens):
    # The default attention; it compiles per (q_len, kv_len), so three short requests.
    eng = Engine(PARAMS, CONFIG, num_pages=6, page_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    assert eng.attention is minilib.ref_ragged_paged_attention
    picked = [0, 2, 4]
    assert eng.generate([PROMPTS[i] for i in picked], 4) == [dense_tokens[i][:4] for i in picked]
    assert_all_pages_free(eng)


def test_pallas_kernel_in_interpret_mode_matches_dense(dense_tokens):
    eng = engine(
        minilib.ragged_paged_attention, num_pages=6, max_num_batched_tokens=8, max_num_seqs=2
    )
    picked = [0, 2]
    assert eng.generate([PROMPTS[i] for i in picked], 3) == [dense_tokens[i][:3] for i in picked]
    assert_all_pages_free(eng)


def test_bfloat16_matches_dense_up_to_near_ties():
    config = ModelConfig(
        vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype="bfloat16"
    )
    params = init_params(config, seed=0)
    dense = [dense_generate_with_margins(params, config, p, MAX_NEW) for p in PROMPTS]
    eng = engine(params=params, config=config, num_pages=10)
    assert eng.kv_pages[0].dtype == jnp.bfloat16
    outputs = eng.generate(PROMPTS, MAX_NEW)
    compared = 0
    for got, (want, margins) in zip(outputs, dense, strict=True):
        clear = next((i for i, m in enumerate(margins) if m < BF16_MARGIN), len(want) - 1)
        assert got[: clear + 1] == want[: clear + 1], (got, want, margins)
        compared += clear + 1
    assert compared >= 0.5 * len(PROMPTS) * MAX_NEW, f"only {compared} tokens compared"
    assert_all_pages_free(eng)


def test_a_wrong_attention_is_caught(dense_tokens):
    """The comparison has teeth: attention that forgets the cached tokens (kv_lens = q_lens)
    gives other tokens."""

    def forgets_the_cache(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
        q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
        return minilib.ragged_paged_attention_jnp(
            q, kv_pages, q_lens, page_indices, cu_q_lens, num_seqs, **options
        )

    assert engine(forgets_the_cache).generate(PROMPTS, MAX_NEW) != dense_tokens


# --- the streaming API and the per-step statistics -------------------------------------------


def test_steps_and_statistics(dense_tokens):
    eng = engine(num_pages=10)
    ids = [eng.add_request(p, MAX_NEW) for p in PROMPTS]
    while eng.has_unfinished:
        stats = eng.step()
        assert stats.num_pages_used == sum(bool(o) for o in stats.page_owners)
        assert stats.num_running <= eng.max_num_seqs
    assert [eng.output(i) for i in ids] == dense_tokens
    # every generated token but the last of each request went through the model as a decode,
    # or was recomputed as a prefill after a preemption
    decodes = sum(s.num_decode_tokens for s in eng.stats)
    assert decodes <= len(PROMPTS) * (MAX_NEW - 1)
    assert sorted(i for s in eng.stats for i in s.finished) == ids
    assert sorted(i for s in eng.stats for i in s.admitted) == sorted(
        ids + [i for s in eng.stats for i in s.preempted]
    )
    assert [s.step for s in eng.stats] == list(range(len(eng.stats)))


def test_max_new_tokens_zero_and_one():
    eng = engine()
    assert eng.generate([[1, 2], [3]], 0) == [[], []]
    assert eng.generate([[1, 2], [3]], 1) == [
        dense_generate(PARAMS, CONFIG, p, 1) for p in ([1, 2], [3])
    ]
    assert_all_pages_free(eng)


# --- bad requests and settings ---------------------------------------------------------------

BAD_REQUESTS = {
    "empty prompt": ([], 4, "empty"),
    "token id too big": ([1, 64], 4, "outside the vocabulary"),
    "negative token id": ([-1, 3], 4, "outside the vocabulary"),
    "float tokens": ([1.5, 2.0], 4, "int token ids"),
    "nested prompt": ([[1, 2]], 4, "flat list"),
    "longer than the pool": ([1] * 40, 4, "whole pool"),
    "prompt fits, generation does not": ([1] * 30, 20, "whole pool"),
    "negative max_new_tokens": ([1], -1, "max_new_tokens"),
    "float max_new_tokens": ([1], 2.0, "max_new_tokens"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_the_others_carry_on(case, dense_tokens):
    prompt, max_new, words = BAD_REQUESTS[case]
    eng = engine(num_pages=10)
    first = eng.add_request(PROMPTS[1], MAX_NEW)
    eng.step()
    before = (dict(eng.requests), list(eng.scheduler.waiting), list(eng.scheduler.running))
    with pytest.raises(EngineError, match=words) as err:
        eng.add_request(prompt, max_new)
    assert "Hint:" in str(err.value)
    assert before == (dict(eng.requests), list(eng.scheduler.waiting), list(eng.scheduler.running))
    second = eng.add_request(PROMPTS[0], MAX_NEW)
    while eng.has_unfinished:
        eng.step()
    assert [eng.output(first), eng.output(second)] == [dense_tokens[1], dense_tokens[0]]
    assert_all_pages_free(eng)


def test_generate_with_a_bad_prompt_names_it_and_queues_nothing(dense_tokens):
    eng = engine()
    with pytest.raises(EngineError, match=r"prompts\[1\]:.*outside the vocabulary"):
        eng.generate([PROMPTS[0], [99], PROMPTS[2]], MAX_NEW)
    assert not eng.requests and not eng.has_unfinished
    assert eng.generate([PROMPTS[0]], MAX_NEW) == [dense_tokens[0]]


def test_dense_generate_refuses_bad_prompts():
    for prompt, max_new, words in BAD_REQUESTS.values():
        if words == "whole pool":
            continue  # the dense model has no pool
        with pytest.raises(EngineError, match=words):
            dense_generate(PARAMS, CONFIG, prompt, max_new)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"num_pages": 0}, "num_pages=0"),
        ({"page_size": 2.5}, "page_size=2.5"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens=-1"),
        ({"max_num_seqs": True}, "max_num_seqs=True"),
        ({"attention": "jnp"}, "not callable"),
        ({"config": "tiny"}, "ModelConfig"),
    ],
)
def test_bad_engine_settings(kwargs, words):
    with pytest.raises(EngineError, match=words):
        engine(**kwargs)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"num_q_heads": 6, "num_kv_heads": 4}, "divisible"),
        ({"head_dim": 33}, "even"),
        ({"vocab_size": 0}, "vocab_size=0"),
        ({"dtype": "float16"}, "float16"),
    ],
)
def test_bad_model_configs(kwargs, words):
    base = {"vocab_size": 64, "num_layers": 1, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 8}
    with pytest.raises(ValueError, match=words):
        ModelConfig(**(base | kwargs))


def test_init_params_is_seeded():
    a, b, c = init_params(CONFIG, 3), init_params(CONFIG, 3), init_params(CONFIG, 4)
    assert np.array_equal(a["embed"], b["embed"]) and not np.array_equal(a["embed"], c["embed"])


# --- sharded over 1, 2 and 4 simulated devices -----------------------------------------------


def run_sharded_check(num_devices: int = 4) -> dict:
    """tests/engine_sharded_check.py in a fresh process with `num_devices` CPU devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    script = ROOT / "tests" / "engine_sharded_check.py"
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sharded():
    return run_sharded_check(4)


def test_sharded_runs_equal_the_unsharded_run_and_the_dense_model(sharded):
    assert sharded["num_devices"] == 4
    for run in sharded["runs"]:
        assert run["tokens"] == run["unsharded"] == run["dense"], run
        assert run["pages_free"], run
    seen = {(run["attention"], run["mesh_size"]) for run in sharded["runs"]}
    want = {(name, size) for name in ("jnp", "blockwise", "kernel", "ref") for size in (2, 4)}
    assert want | {("jnp", 1)} <= seen, seen


def test_sharded_kv_pages_are_split_by_kv_head(sharded):
    # Each device holds 2*num_kv_heads/D of the combined head axis: its KV heads' K and V.
    assert sharded["shard_shapes"]["4"] == [[16, 4, 2, 32]] * 4


def test_sharded_projections_are_split_by_head(sharded):
    specs = sharded["weight_specs"]
    for name in ("wq", "wk", "wv", "wo"):
        assert "kv_heads" in specs[name], specs
    assert "kv_heads" not in specs["w_in"] + specs["w_out"], specs


def test_bad_meshes_get_clear_errors(sharded):
    assert "num_kv_heads=2 is not divisible" in sharded["errors"]["kv heads not divisible"]
    assert "'model'" in sharded["errors"]["unknown axis"]
    assert "Hint:" in sharded["errors"]["unknown axis"]
    assert "not a jax.sharding.Mesh" in sharded["errors"]["not a mesh"]


# --- the live view ---------------------------------------------------------------------------


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

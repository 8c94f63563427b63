"""What the engine's test modules share: the tiny model and its prompts, the dense model's
tokens, an engine of small sizes, and its pool's books checked after every step."""

from __future__ import annotations

import numpy as np
import pytest

import minilib
from minilib.engine import Engine, ModelConfig, dense_generate, init_params

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


def checked_step(eng: Engine):
    """One step, then the pool's books: every count, the free queue, the cached pages."""
    stats = eng.step()
    problems = eng.scheduler.accounting_problems()
    assert not problems, f"after step {stats.step}: {problems}"
    return stats


def run_checked(eng: Engine, aborts=None):
    """Step to the end, checking the books after every step; `aborts` maps a step to the
    request ids aborted right after it (checked too)."""
    while eng.has_unfinished:
        stats = checked_step(eng)
        for request_id in (aborts or {}).get(stats.step, ()):
            eng.abort_request(request_id)
            assert not eng.scheduler.accounting_problems(), f"abort of {request_id}"


PAGE = 4
SYSTEM = np.random.default_rng(5).integers(0, 64, 10).tolist()  # 2 full pages and 2 tokens


def shared_prefix_prompts():
    rng = np.random.default_rng(6)
    a = SYSTEM + rng.integers(0, 64, 3).tolist()  # 13 tokens: 3 full pages
    b = SYSTEM + rng.integers(0, 64, 5).tolist()  # shares pages 0 and 1 with a
    c = list(a)  # wholly cached but for its last token: 12 of 13 hit
    d = SYSTEM[:8]  # 8 tokens, both pages cached: the last page is computed anew
    e = rng.integers(0, 64, 6).tolist()  # nothing in common
    f = rng.integers(0, 64, 4).tolist() + SYSTEM[4:8]  # a's page 1, after another page 0
    return [a, b, c, d, e, f], [0, 8, 12, 4, 0, 0]

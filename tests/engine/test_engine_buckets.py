"""minilib.engine.buckets: every step padded to a bucket, every bucket compiled at warm-up.

The count is XLA's own (`CompileCounter`: JAX's backend-compile event, one per compile of a
jitted function, an eager operation or the attention function alike). Over a long mixed run
(chunked prefill, decodes, speculative decoding, prefix caching, preemption, sampling,
logprobs, aborts) nothing compiles after `warm_up()`; the same run without warm-up compiles,
so the count can fail. Padding is idle: the tokens are the dense model's.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from minilib.engine import Engine, EngineError, ModelConfig, SamplingParams, init_params
from minilib.engine.buckets import (
    CompileCounter,
    bucket_for,
    padding_waste,
    power_of_two_buckets,
    reachable_shapes,
)
from minilib.engine.model import dense_generate

CONFIG = ModelConfig(vocab_size=64, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16)
PARAMS = init_params(CONFIG, seed=0)
SIZES = {"num_pages": 24, "page_size": 4, "max_num_batched_tokens": 24, "max_num_seqs": 6}
BUCKETS = {"token_buckets": power_of_two_buckets(8, 24), "seq_buckets": [3, 6]}


def test_power_of_two_buckets_are_vllms():
    assert power_of_two_buckets(16, 2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert power_of_two_buckets(16, 100) == [16, 32, 64, 128]  # the first to cover the limit
    assert power_of_two_buckets(8, 100, cover=False) == [8, 16, 32, 64, 100]  # ends at it
    assert [bucket_for(n, [4, 8, 16]) for n in (1, 4, 5, 16)] == [4, 4, 8, 16]
    assert padding_waste([4, 5, 16], [4, 8, 16]) == 1.0
    with pytest.raises(EngineError, match="minimum=6 must be a power of two"):
        power_of_two_buckets(6, 32)


def test_reachable_shapes_are_every_shape_a_step_can_take():
    shapes = set(reachable_shapes([4, 8, 16], [2, 4, 6], max_num_seqs=6))
    seen = {
        (bucket_for(t, [4, 8, 16]), bucket_for(s, [2, 4, 6]))
        for s in range(1, 7)
        for t in range(s, 17)
    }
    assert shapes == seen


def shapes_steps_take(token_buckets, seq_buckets, max_num_seqs) -> set[tuple[int, int]]:
    """By brute force: every step of n sequences (1 to max_num_seqs) and t tokens (at least
    one a sequence, at most the last token bucket), padded to its buckets."""
    return {
        (bucket_for(t, token_buckets), bucket_for(n, seq_buckets))
        for n in range(1, max_num_seqs + 1)
        for t in range(n, token_buckets[-1] + 1)
    }


def increasing(values):
    return st.lists(values, min_size=1, max_size=4, unique=True).map(sorted)


@settings(max_examples=300, deadline=None)
@given(
    token_buckets=increasing(st.integers(1, 24)),
    seq_buckets=increasing(st.integers(1, 8)),
    max_num_seqs=st.integers(1, 8),
)
def test_reachable_shapes_are_the_shapes_steps_take(token_buckets, seq_buckets, max_num_seqs):
    """Against the brute force, on small bucket lists, edges included (a bucket equal to the
    fewest sequences it holds, max_num_seqs equal to a token bucket)."""
    assume(seq_buckets[-1] >= max_num_seqs)  # check_buckets refuses the others
    shapes = reachable_shapes(token_buckets, seq_buckets, max_num_seqs)
    assert len(shapes) == len(set(shapes))
    assert set(shapes) == shapes_steps_take(token_buckets, seq_buckets, max_num_seqs)


def test_the_brute_force_catches_a_shape_dropped_at_the_edge():
    """The check above can fail: a rule with `<` where `<=` belongs drops the shapes whose
    token bucket holds exactly the fewest sequences of their sequence bucket, and the
    engine would compile three times after `warm_up()`."""

    def reachable_with_less_than(token_buckets, seq_buckets, max_num_seqs):
        return {
            (t, s)
            for t in token_buckets
            for i, s in enumerate(seq_buckets)
            if (seq_buckets[i - 1] + 1 if i else 1) < min(t, max_num_seqs)
        }

    wrong = reachable_with_less_than([1, 2, 4], [1, 2], max_num_seqs=2)
    missed = shapes_steps_take([1, 2, 4], [1, 2], max_num_seqs=2) - wrong
    assert missed == {(1, 1), (2, 2), (4, 2)}
    assert set(reachable_shapes([1, 2, 4], [1, 2], max_num_seqs=2)) >= missed


def stream(rng: np.random.Generator) -> list[tuple[list[int], SamplingParams]]:
    """Requests of every kind: short and long prompts, shared prefixes, prompts that repeat
    (drafts), greedy and sampled, some with logprobs and stop tokens."""
    prefix = rng.integers(0, 64, 8).tolist()
    requests = []
    for i in range(30):
        n = int(rng.choice([1, 3, 7, 20, 30]))
        prompt = (prefix if i % 3 == 0 else []) + rng.integers(0, 64, n).tolist()
        if i % 4 == 1:
            prompt = [5, 6, 7, 8] * 4
        requests.append((prompt, SamplingParams(
            max_tokens=int(rng.integers(1, 16)), temperature=float(rng.choice([0.0, 0.8])),
            seed=i, logprobs=2 if i % 5 == 0 else None,
            stop_token_ids=[int(rng.integers(64))] if i % 6 == 0 else [],
        )))  # fmt: skip
    return requests


def serve(eng: Engine, requests) -> dict[int, list[int]]:
    """Requests arrive a few per step; one is aborted on the way."""
    ids, pending, step = [], list(requests), 0
    while pending or eng.has_unfinished:
        for _ in range(3 if step % 2 == 0 else 0):
            if pending:
                prompt, params = pending.pop(0)
                ids.append(eng.add_request(prompt, sampling_params=params))
        if eng.has_unfinished:
            eng.step()
        if step == 5:
            eng.abort_request(ids[1])
        step += 1
    return {i: eng.output(i) for i in ids}


@pytest.fixture(scope="module")
def warmed():
    eng = Engine(PARAMS, CONFIG, num_speculative_tokens=3, enable_prefix_caching=True,
                 **SIZES, **BUCKETS)  # fmt: skip
    warm_up = CompileCounter()
    num_shapes = eng.warm_up()
    return eng, num_shapes, warm_up.count


def test_nothing_compiles_after_warm_up_over_a_long_mixed_run(warmed):
    eng, num_shapes, warm_up_compiles = warmed
    assert BUCKETS["token_buckets"] == [8, 16, 32]
    assert num_shapes == len(reachable_shapes([8, 16, 32], [3, 6], 6)) == 6
    assert warm_up_compiles > 0
    requests = stream(np.random.default_rng(0))
    serving = CompileCounter()
    outputs = serve(eng, requests)
    assert serving.count == 0, f"{serving.count} compiles while serving"
    # It was a long mixed run, through every bucket ...
    stats = eng.stats
    assert len(stats) > 40
    assert sum(s.num_preempted for s in stats) > 0
    assert sum(s.num_accepted_tokens for s in stats) > 0
    assert sum(s.num_cached_tokens for s in stats) > 0
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats)
    used = {(bucket_for(s.num_tokens, BUCKETS["token_buckets"]), len(s.batch)) for s in stats}
    assert {t for t, _ in used} == set(BUCKETS["token_buckets"])
    # ... and padding is idle: the tokens are the dense model's.
    for (i, got), (prompt, params) in zip(outputs.items(), requests, strict=True):
        want = dense_generate(PARAMS, CONFIG, prompt, sampling_params=params)
        if i == 1:  # aborted
            assert got == want[: len(got)]
        elif params.greedy:
            assert got == want, i
    assert eng.scheduler.allocator.num_free == eng.num_pages


def test_each_step_is_padded_to_its_buckets(warmed):
    eng = warmed[0]
    eng.add_request([1, 2, 3, 4, 5], max_new_tokens=2)
    eng.step()
    batch = eng.last_batch
    assert batch.tokens.shape == (8,) and batch.kv_lens.shape == (3,)  # 5 rows -> 8, 1 seq -> 3
    assert batch.num_tokens == 5
    assert (batch.page_ids[5:] == eng.num_pages).all(), "padding rows write nowhere"
    assert batch.cu_q_lens.tolist() == [0, 5, 5, 5], "padding slots have q_len 0"
    while eng.has_unfinished:
        eng.step()


def test_without_warm_up_the_same_run_compiles():
    """The count has teeth: buckets this process has not compiled yet compile while serving."""
    eng = Engine(PARAMS, CONFIG, num_speculative_tokens=3, **SIZES,
                 token_buckets=[3, 6, 12, 24], seq_buckets=[3, 6])  # fmt: skip
    serving = CompileCounter()
    serve(eng, stream(np.random.default_rng(0))[:2])
    assert serving.count > 0


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"token_buckets": [8, 16]}, r"token_buckets=\[8, 16\]: its last bucket, 16, is "
         r"smaller than max_num_batched_tokens=24: a full step would fit no bucket"),
        ({"token_buckets": [16, 8, 32]}, r"token_buckets=\[16, 8, 32\]: the buckets must "
         "increase strictly"),
        ({"token_buckets": [8, 8, 32]}, "must increase strictly"),
        ({"token_buckets": []}, r"token_buckets=\[\] must be a non-empty list of positive"),
        ({"token_buckets": [0, 32]}, r"token_buckets=\[0, 32\] must be a non-empty list"),
        ({"token_buckets": 32}, "token_buckets=32 must be a non-empty list"),
        ({"seq_buckets": [2, 4]}, r"seq_buckets=\[2, 4\]: its last bucket, 4, is smaller "
         "than max_num_seqs=6"),
        ({"seq_buckets": [2.0, 6]}, r"seq_buckets=\[2.0, 6\] must be a non-empty list"),
    ],
)  # fmt: skip
def test_bucket_lists_that_cannot_work_are_refused(kwargs, words):
    with pytest.raises(EngineError, match=words) as err:
        Engine(PARAMS, CONFIG, **SIZES, **kwargs)
    assert err.value.hint

"""Every exercise checker, run three ways:

* against its worked solution in `solutions/`: it must pass;
* against a plausible wrong answer, a mistake learners make: it must fail, and say why;
* against the unfilled stub: it must report "not attempted" and not raise.

And the checkers' own promises: they never raise on a learner's error, they print their report
unless told not to, and every one of them is used by a notebook.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, one_case_per_path
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from ladder_wrong_answers import flash_call

import minilib.exercises as ex
from minilib.ladder.flash import init_online_softmax

ROOT = Path(__file__).resolve().parents[2]


def solution(module: str, name: str):
    """Function `name` of solutions/<module>.py (a folder, not a package, kept apart from
    minilib so that learners do not import it by accident)."""
    path = ROOT / "solutions" / f"{module}.py"
    spec = importlib.util.spec_from_file_location(f"solutions_{module}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


# --- plausible wrong answers, one per exercise ------------------------------------------------


def gather_kv_halves(kv_pages, pages, kv_len):
    # K taken as the first half of the combined head axis, V as the second: not interleaved.
    _, page_size, combined, head_dim = kv_pages.shape
    tokens = kv_pages[pages].reshape(-1, combined, head_dim)[:kv_len]
    return tokens[:, : combined // 2], tokens[:, combined // 2 :]


def causal_mask_no_offset(q_len, kv_len):
    # Treats the new rows as the first q_len tokens instead of the last.
    return jnp.arange(kv_len)[None, :] > jnp.arange(q_len)[:, None]


def seq_for_row_left(cu_q_lens, num_seqs, row):
    # side="left": a row at a sequence boundary goes to the sequence that ends there.
    n = int(num_seqs[0])
    return int(np.searchsorted(np.asarray(cu_q_lens)[1 : n + 1], row, side="left"))


def attend_cap_after_mask(q, k, v, *, sm_scale, soft_cap):
    # Soft-caps after masking, so masked keys get the score -soft_cap instead of ~-inf.
    q_len, num_q_heads, _ = q.shape
    group = num_q_heads // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    scores = jnp.einsum("qhd,khd->hqk", q, k) * sm_scale
    q_pos = (k.shape[0] - q_len) + jnp.arange(q_len)[:, None]
    scores = jnp.where(jnp.arange(k.shape[0])[None, :] > q_pos, -1e30, scores)
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v)


def sliding_window_off_by_one(q_len, kv_len, sliding_window):
    # Lets each row see sliding_window + 1 keys.
    q_pos = (kv_len - q_len) + jnp.arange(q_len)[:, None]
    k_pos = jnp.arange(kv_len)[None, :]
    return (k_pos > q_pos) | (k_pos < q_pos - sliding_window)


def online_softmax_no_rescale(m, l, acc, scores, v):
    # Rescales l but forgets acc when the max rises.
    m_new = jnp.maximum(m, scores.max(-1))
    alpha, p = jnp.exp(m - m_new), jnp.exp(scores - m_new[:, None])
    return m_new, alpha * l + p.sum(-1), acc + p @ v


def softmax_kernel_without_max(x_ref, o_ref):
    # exp overflows for large scores without subtracting the row's max.
    e = jnp.exp(x_ref[...])
    o_ref[...] = e / e.sum(axis=-1, keepdims=True)


def kv_blocks_from_the_last_row(first_q_pos, last_q_pos, kv_tokens_per_block, sliding_window):
    # The window of the last row, not the first: skips blocks the first row sees.
    end = last_q_pos // kv_tokens_per_block + 1
    if sliding_window is None:
        return 0, end
    return max(last_q_pos - sliding_window + 1, 0) // kv_tokens_per_block, end


def can_admit_whole_prompt(num_prompt_tokens, *, token_budget_left, num_free_pages, page_size,
                           num_running, max_num_seqs):  # fmt: skip
    # Asks for the pages of the whole prompt, not just of this step's first chunk.
    return (num_running < max_num_seqs and token_budget_left > 0
            and -(-num_prompt_tokens // page_size) <= num_free_pages)  # fmt: skip


def preempt_keeps_num_computed(request, allocator):
    # Frees the pages but still believes their K/V is cached.
    allocator.free(request.pages)
    request.pages = []


def cache_full_pages_taking_a_reference(request, pool, page_size):
    # Counts the cache as a holder: the count never drops to 0 when the request lets go.
    from minilib.engine.prefix_cache import hash_block_tokens

    for i in range(len(request.block_hashes), request.num_computed // page_size):
        parent = request.block_hashes[-1] if request.block_hashes else None
        block_hash = hash_block_tokens(parent, request.tokens[i * page_size : (i + 1) * page_size])
        pool.cache_page(request.pages[i], block_hash)
        pool.touch([request.pages[i]])
        request.block_hashes.append(block_hash)


def flash_attention_without_init():
    # Forgets to reset m, l and acc on the first KV block: scratch starts as NaN here.
    from minilib.ladder import flash

    def kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, kv_len, q_len, sm_scale):
        i, j = pl.program_id(1), pl.program_id(2)
        rows, cols = q_ref.shape[0], k_ref.shape[0]
        q_pos = kv_len - q_len + i * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        k_pos = j * cols + jax.lax.broadcasted_iota(jnp.int32, (1, cols), 1)
        v = flash.zero_rows_past(v_ref[...], j * cols, kv_len)
        visible = (k_pos <= q_pos) & (k_pos < kv_len)
        flash.online_softmax_update(
            m_ref, l_ref, acc_ref, q_ref[...], k_ref[...], v, visible, sm_scale
        )

        @pl.when(j == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)

    return functools.partial(flash.flash_attention, kernel=kernel)


def paged_decode_ignoring_page_table():
    # The index map returns page i itself, not page_indices[seq, i].
    from minilib.ladder import scalar_prefetch

    def index_map(seq, i, kv_lens_ref, page_indices_ref, *, page_size):
        return (i, 0, 0, 0)

    return functools.partial(scalar_prefetch.paged_decode_attention, index_map=index_map)


def async_copy_without_wait():
    # Starts the copy and reads the buffer at once, never waiting: a race.
    from minilib.ladder import async_copy
    from minilib.ladder.scalar_prefetch import attend_kv_block, write_output

    def kernel(kv_lens_ref, page_indices_ref, q_ref, kv_hbm_ref, o_ref, buf, sem, m_ref, l_ref,
               acc_ref, *, sm_scale):  # fmt: skip
        seq, i = pl.program_id(0), pl.program_id(1)
        kv_len, page_size = kv_lens_ref[seq], buf.shape[0]

        @pl.when(i == 0)
        def _():
            init_online_softmax(m_ref, l_ref, acc_ref)

        @pl.when(i * page_size < kv_len)
        def _():
            pltpu.make_async_copy(kv_hbm_ref.at[page_indices_ref[seq, i]], buf, sem).start()
            attend_kv_block(buf, q_ref, m_ref, l_ref, acc_ref, i * page_size, kv_len, sm_scale)

        @pl.when(i == pl.num_programs(1) - 1)
        def _():
            write_output(o_ref, l_ref, acc_ref)

    return functools.partial(async_copy.paged_decode_attention_async_copy, kernel=kernel)


def double_buffer_computing_before_waiting():
    # Computes with page i before waiting for its copy: a race. (Starting page i + 1 into the
    # slot being read is a race too, but it deadlocks in interpret mode; the checker reports
    # that after a timeout, which a test should not sit through.)
    from minilib.ladder import double_buffer
    from minilib.ladder.scalar_prefetch import attend_kv_block, write_output

    def kernel(kv_lens_ref, page_indices_ref, q_ref, kv_hbm_ref, o_ref, bufs, sems, m_ref, l_ref,
               acc_ref, *, sm_scale):  # fmt: skip
        seq = pl.program_id(0)
        kv_len, page_size = kv_lens_ref[seq], bufs.shape[1]

        def page_copy(i, slot):
            page = page_indices_ref[seq, i]
            return pltpu.make_async_copy(kv_hbm_ref.at[page], bufs.at[slot], sems.at[slot])

        def body(i, _):
            slot = i % 2

            @pl.when(i + 1 < pl.cdiv(kv_len, page_size))
            def _():
                page_copy(i + 1, 1 - slot).start()

            attend_kv_block(bufs.at[slot], q_ref, m_ref, l_ref, acc_ref, i * page_size, kv_len,
                            sm_scale)  # fmt: skip
            page_copy(i, slot).wait()  # too late

        init_online_softmax(m_ref, l_ref, acc_ref)
        page_copy(0, 0).start()
        jax.lax.fori_loop(0, pl.cdiv(kv_len, page_size), body, None)
        write_output(o_ref, l_ref, acc_ref)

    return functools.partial(double_buffer.paged_decode_attention_double_buffered, kernel=kernel)


def prefetch_never_flipping_the_slot():
    # Uses slot 0 for every page: the next page's copy overwrites the one being read.
    from minilib.ladder import prefetch
    from minilib.ladder.scalar_prefetch import attend_kv_block, write_output

    def kernel(kv_lens_ref, page_indices_ref, q_ref, kv_hbm_ref, o_ref, bufs, sems, slot_ref,
               m_ref, l_ref, acc_ref, *, sm_scale):  # fmt: skip
        seq, num_seqs = pl.program_id(0), pl.num_programs(0)
        kv_len, page_size = kv_lens_ref[seq], bufs.shape[1]

        def page_copy(seq, i):
            page = page_indices_ref[seq, i]
            return pltpu.make_async_copy(kv_hbm_ref.at[page], bufs.at[0], sems.at[0])

        @pl.when(seq == 0)
        def _():
            page_copy(0, 0).start()

        def body(i, _):
            has_next, next_seq, next_page = prefetch.next_work_in_kernel(
                seq, i, kv_lens_ref, num_seqs, page_size
            )

            @pl.when(has_next)
            def _():
                page_copy(next_seq, next_page).start()

            page_copy(seq, i).wait()
            attend_kv_block(bufs.at[0], q_ref, m_ref, l_ref, acc_ref, i * page_size, kv_len,
                            sm_scale)  # fmt: skip

        init_online_softmax(m_ref, l_ref, acc_ref)
        jax.lax.fori_loop(0, pl.cdiv(kv_len, page_size), body, None)
        write_output(o_ref, l_ref, acc_ref)

    return functools.partial(prefetch.paged_decode_attention_prefetch, kernel=kernel)


def next_work_stopping_at_sequence_end(seq, page, kv_lens, num_seqs, page_size):
    # Never crosses to the next sequence: no prefetch across grid steps.
    return (seq, page + 1) if (page + 1) * page_size < kv_lens[seq] else None


# (checker, solutions module, function name, wrong answer)
EXERCISES = [
    (ex.check_gather_kv, "ex02_paged_cache", "gather_kv", gather_kv_halves),
    (ex.check_causal_mask, "ex03_ragged", "causal_mask", causal_mask_no_offset),
    (ex.check_seq_for_row, "ex03_ragged", "seq_for_row", seq_for_row_left),
    (ex.check_attend_soft_cap, "ex04_reference", "attend_soft_cap", attend_cap_after_mask),
    (
        ex.check_sliding_window_mask,
        "ex04_reference",
        "sliding_window_mask",
        sliding_window_off_by_one,
    ),
    (
        ex.check_online_softmax_update,
        "ex06_online_softmax",
        "online_softmax_update",
        online_softmax_no_rescale,
    ),
    (ex.check_softmax_kernel, "ex07_pallas", "softmax_kernel", softmax_kernel_without_max),
    (
        ex.check_kv_blocks_to_visit,
        "ex08_kernel",
        "kv_blocks_to_visit",
        kv_blocks_from_the_last_row,
    ),
    (
        ex.check_flash_attention,
        "ex07_flash",
        "flash_attention",
        flash_attention_without_init(),
    ),
    (
        ex.check_paged_decode_attention,
        "ex08_ladder",
        "paged_decode_attention",
        paged_decode_ignoring_page_table(),
    ),
    (
        ex.check_paged_decode_async_copy,
        "ex08_ladder",
        "paged_decode_async_copy",
        async_copy_without_wait(),
    ),
    (
        ex.check_double_buffered_decode,
        "ex08_ladder",
        "double_buffered_decode",
        double_buffer_computing_before_waiting(),
    ),
    (ex.check_next_work, "ex08_ladder", "next_work", next_work_stopping_at_sequence_end),
    (
        ex.check_prefetching_decode,
        "ex08_ladder",
        "prefetching_decode",
        prefetch_never_flipping_the_slot(),
    ),
    (
        ex.check_flash_pallas_call,
        "ex07_flash",
        "flash_attention_call",
        flash_call("all_parallel"),  # the KV axis "parallel": split and shuffled on megacore
    ),
    (ex.check_can_admit, "ex10_engine", "can_admit", can_admit_whole_prompt),
    (ex.check_preempt, "ex10_engine", "preempt", preempt_keeps_num_computed),
    (
        ex.check_cache_full_pages,
        "ex10_engine",
        "cache_full_pages",
        cache_full_pages_taking_a_reference,
    ),
]
IDS = [checker.__name__.removeprefix("check_") for checker, *_ in EXERCISES]


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISES, ids=IDS)
def test_solution_passes(checker, module, name, wrong):
    result = checker(solution(module, name), verbose=False)
    assert result.passed, result.report
    assert bool(result) and result.cases_run > 0


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISES, ids=IDS)
def test_wrong_answer_fails_and_says_why(checker, module, name, wrong):
    result = checker(wrong, verbose=False)
    assert result.status == "failed", result.report
    assert not result
    if checker not in KERNEL_CHECKERS:  # a kernel's DMA problem is no expected/got diff
        assert "expected" in result.report or "raised" in result.report, result.report
    assert "Likely cause:" in result.report, result.report


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISES, ids=IDS)
def test_unfilled_stub_is_not_attempted(checker, module, name, wrong):
    def stub(*args, **kwargs):
        raise NotImplementedError("FILL ME IN")

    result = checker(stub, verbose=False)
    assert result.status == "not attempted", result.report
    assert not result


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISES, ids=IDS)
def test_learner_errors_are_reported_not_raised(checker, module, name, wrong):
    def broken(*args, **kwargs):
        return 1 / 0

    result = checker(broken, verbose=False)
    assert result.status == "failed"
    assert "ZeroDivisionError" in result.report
    assert "return 1 / 0" in result.report, "the report should show the learner's line"


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISES, ids=IDS)
def test_returning_none_is_reported(checker, module, name, wrong):
    if checker is ex.check_validate_page_indices:  # returning None: a validator's "valid"
        pytest.skip("validators return None")
    result = checker(lambda *args, **kwargs: None, verbose=False)
    assert result.status == "failed", result.report


def test_checkers_print_their_report(capsys):
    result = ex.check_live_seq_lens(solution("ex00_tour", "live_seq_lens"))
    assert capsys.readouterr().out.strip() == result.report
    assert result.report.startswith("Passed")


# Each checker on two more seeds: seed 1 on every stack, seed 2 once, in .venv.
OTHER_SEEDS = one_case_per_path(
    [
        pytest.param(exercise, seed, id=f"{exercise[0].__name__}-seed{seed}")
        for exercise in EXERCISES
        for seed in (1, 2)
    ],
    *(f"{exercise[0].__name__}-seed1" for exercise in EXERCISES),
)


@pytest.mark.parametrize("exercise, seed", OTHER_SEEDS)
def test_other_seeds_pass_too(exercise, seed):
    checker, module, name, _ = exercise
    assert checker(solution(module, name), seed=seed, verbose=False), checker.__name__


def test_every_checker_is_tested_and_used_in_a_notebook():
    checkers = {n for n in ex.__all__ if n.startswith("check_")}
    assert checkers == {checker.__name__ for checker, *_ in EXERCISES + MORE_EXERCISES}
    notebook_code = ""
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] == "code":
                notebook_code += "".join(cell["source"])
    unused = [name for name in sorted(checkers) if f"{name}(" not in notebook_code]
    assert not unused, f"checkers no notebook calls: {unused}"


# --- exercises that carry each notebook's idea further -----------------------------------------


def live_seq_lens_every_slot(kv_lens, cu_q_lens, num_seqs):
    # Reads the padding slots past num_seqs too.
    return [(int(cu_q_lens[i + 1] - cu_q_lens[i]), int(kv_lens[i])) for i in range(len(kv_lens))]


def grouped_query_attention_interleaved(q, k, v, *, sm_scale):
    # Groups q heads as [tokens, group, num_kv_heads, head_dim]: head h reads KV head h % nkv.
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    q_grouped = q.reshape(num_tokens, group, k.shape[1], head_dim)
    scores = jnp.einsum("qghd,khd->hgqk", q_grouped, k) * sm_scale
    future = jnp.arange(num_tokens)[None, :] > jnp.arange(num_tokens)[:, None]
    probs = jax.nn.softmax(jnp.where(future, -jnp.inf, scores), axis=-1)
    return jnp.einsum("hgqk,khd->qghd", probs, v).reshape(num_tokens, num_q_heads, head_dim)


def repeat_kv_pages_on_combined_axis(kv_pages, num_q_heads):
    # Repeats each slot (K0 K0 V0 V0 ...), which breaks the K/V interleave.
    return jnp.repeat(kv_pages, num_q_heads // (kv_pages.shape[2] // 2), axis=2)


def write_new_tokens_after_kv_len(kv_pages, pages, kv_len, new_k, new_v):
    # Takes kv_len as the length before the write: writes past the sequence's end.
    positions = kv_len + jnp.arange(new_k.shape[0])
    page_size = kv_pages.shape[1]
    page, slot = jnp.asarray(pages)[positions // page_size], positions % page_size
    return kv_pages.at[page, slot, 0::2].set(new_k).at[page, slot, 1::2].set(new_v)


def validate_page_indices_whole_rows(kv_pages, kv_lens, page_indices, num_seqs):
    # Checks every column of a live row, though the unused ones may hold anything.
    table = np.asarray(page_indices)
    for i in range(int(num_seqs[0])):
        for j, page in enumerate(table[i].tolist()):
            if not 0 <= page < kv_pages.shape[0]:
                raise ValueError(f"page_indices[{i}, {j}]={page}")


def decode_attention_masks_scores_only(q, kv_pages, kv_lens, page_indices, *, sm_scale):
    # Masks the scores past kv_len but multiplies the weights 0 by V's NaN padding.
    num_seqs, num_q_heads, head_dim = q.shape
    combined = kv_pages.shape[2]
    slots = kv_pages[page_indices].reshape(num_seqs, -1, combined, head_dim)
    live = jnp.arange(slots.shape[1])[None, :] < kv_lens[:, None]
    k, v = slots[:, :, 0::2], slots[:, :, 1::2]
    q_grouped = q.reshape(num_seqs, combined // 2, -1, head_dim)
    scores = jnp.einsum("shgd,skhd->shgk", q_grouped, k) * sm_scale
    scores = jnp.where(live[:, None, None, :], scores, -1e30)
    out = jnp.einsum("shgk,skhd->shgd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(num_seqs, num_q_heads, head_dim)


def arithmetic_intensity_every_pair(
    seq_lens, *, num_q_heads, num_kv_heads, head_dim, page_size, itemsize
):
    # Counts q_len * kv_len pairs, as if there were no causal mask.
    live = [(q, kv) for q, kv in seq_lens if q > 0]
    flops = 4 * head_dim * num_q_heads * sum(q * kv for q, kv in live)
    rows = sum(q for q, _ in live)
    slots = sum(-(-kv // page_size) * page_size for _, kv in live)
    kv_bytes = slots * 2 * num_kv_heads * head_dim * itemsize
    return flops / (2 * rows * num_q_heads * head_dim * itemsize + kv_bytes)


def num_kv_pages_per_block_one_slot(vmem_budget_bytes, *, page_size, pages_per_seq,
                                    num_kv_heads_per_block, group, head_dim, itemsize,
                                    num_queries_per_block):  # fmt: skip
    # Forgets that the KV block is double-buffered: one slot per page.
    q_and_out = 4 * num_queries_per_block * num_kv_heads_per_block * group * head_dim * itemsize
    state = num_kv_heads_per_block * num_queries_per_block * group * (256 + head_dim) * 4
    per_page = page_size * 2 * num_kv_heads_per_block * head_dim * itemsize
    room = vmem_budget_bytes - q_and_out - state
    return max(0, min(room // per_page, pages_per_seq))


# (checker, solutions module, function name, wrong answer, a word of the likely cause)
MORE_EXERCISES = [
    (ex.check_live_seq_lens, "ex00_tour", "live_seq_lens", live_seq_lens_every_slot, "live"),
    (
        ex.check_grouped_query_attention,
        "ex01_heads",
        "grouped_query_attention",
        grouped_query_attention_interleaved,
        "consecutive",
    ),
    (
        ex.check_repeat_kv_pages,
        "ex01_heads",
        "repeat_kv_pages",
        repeat_kv_pages_on_combined_axis,
        "interleave",
    ),
    (
        ex.check_write_new_tokens,
        "ex02_paged_cache",
        "write_new_tokens",
        write_new_tokens_after_kv_len,
        "kv_len - n",
    ),
    (
        ex.check_validate_page_indices,
        "ex05_validation",
        "validate_page_indices",
        validate_page_indices_whole_rows,
        "columns",
    ),
    (
        ex.check_decode_attention,
        "ex06_vectorized",
        "decode_attention",
        decode_attention_masks_scores_only,
        "0 * NaN",
    ),
    (
        ex.check_arithmetic_intensity,
        "ex09_performance",
        "arithmetic_intensity",
        arithmetic_intensity_every_pair,
        "visible pairs",
    ),
    (
        ex.check_num_kv_pages_per_block,
        "ex09_performance",
        "num_kv_pages_per_block",
        num_kv_pages_per_block_one_slot,
        "two slots",
    ),
]


@pytest.mark.parametrize(
    "checker, module, name, wrong, cause",
    MORE_EXERCISES,
    ids=[checker.__name__.removeprefix("check_") for checker, *_ in MORE_EXERCISES],
)
def test_solution_passes_wrong_answer_fails_stub_not_attempted(checker, module, name, wrong, cause):
    passed = checker(solution(module, name), verbose=False)
    assert passed.passed and passed.cases_run > 1, passed.report

    failed = checker(wrong, verbose=False)
    assert failed.status == "failed", failed.report
    assert "Likely cause:" in failed.report and cause in failed.report, failed.report

    def stub(*args, **kwargs):
        raise NotImplementedError("FILL ME IN")

    assert checker(stub, verbose=False).status == "not attempted"


def decode_attention_one_seq(q, kv_pages, kv_len, pages, *, sm_scale):
    # One sequence: q [num_q_heads, head_dim], its kv_len and its row of page_indices.
    num_q_heads, head_dim = q.shape
    combined = kv_pages.shape[2]
    slots = kv_pages[pages].reshape(-1, combined, head_dim)
    live = jnp.arange(slots.shape[0]) < kv_len
    slots = jnp.where(live[:, None, None], slots, 0.0)
    k, v = slots[:, 0::2], slots[:, 1::2]
    scores = jnp.einsum("hgd,khd->hgk", q.reshape(combined // 2, -1, head_dim), k) * sm_scale
    scores = jnp.where(live, scores, -1e30)
    out = jnp.einsum("hgk,khd->hgd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(num_q_heads, head_dim)


def decode_attention_loop_over_slots(q, kv_pages, kv_lens, page_indices, *, sm_scale):
    # A Python loop over range(q.shape[0]): it runs under jit, unrolled, one copy per slot.
    out = []
    for i in range(q.shape[0]):
        out.append(decode_attention_one_seq(q[i], kv_pages, kv_lens[i], page_indices[i],
                                            sm_scale=sm_scale))  # fmt: skip
    return jnp.stack(out)


def decode_attention_vmapped(q, kv_pages, kv_lens, page_indices, *, sm_scale):
    one_seq = functools.partial(decode_attention_one_seq, sm_scale=sm_scale)
    return jax.vmap(one_seq, in_axes=(0, None, 0, 0))(q, kv_pages, kv_lens, page_indices)


def test_decode_attention_checker_rejects_a_loop_over_the_slots_not_vmap():
    """A loop over range(q.shape[0]) runs under jit, and its output is right: the checker sees
    it unrolled, as a program that grows with the number of slots. jax.vmap does not unroll."""
    looped = ex.check_decode_attention(decode_attention_loop_over_slots, verbose=False)
    assert looped.status == "failed", looped.report
    assert "one copy of its body per sequence slot" in looped.report, looped.report
    assert "kv_pages[page_indices]" in looped.report, looped.report
    vmapped = ex.check_decode_attention(decode_attention_vmapped, verbose=False)
    assert vmapped.passed, vmapped.report


def test_decode_attention_checker_reference_matches_jax():
    """check_decode_attention compares with a small NumPy reference: it must agree with JAX's
    own reference on a NaN-padded batch."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ref_ragged_paged_attention as jax_reference,
    )

    from minilib.batch import make_batch
    from minilib.exercises.ex06_vectorized import _reference

    batch = make_batch([(1, 5), (1, 16), (1, 1)], num_q_heads=6, num_kv_heads=2, page_size=4)
    ours = _reference(batch.q, batch.kv_pages, batch.kv_lens, batch.page_indices, sm_scale=0.3)
    theirs = jax_reference(*batch.args(), sm_scale=0.3)
    assert_close(ours, theirs, batch.q.dtype)


# --- robustness: every checker, NumPy answers, wrong types, errors, endless loops -------------
#
# These tests run over EXERCISES and MORE_EXERCISES, so a checker added there is covered too.
# Two tables say where an exercise differs from the usual "a function that returns arrays or
# numbers":
#   NUMPY_NOT_APPLICABLE: why the exercise cannot be solved in NumPy;
#   WRONG_TYPE: a wrong-type answer, for exercises whose answer is not a returned value.

# The checkers of Pallas kernels (minilib.exercises.kernel_checking): their kernel run has a
# time limit of its own, and a NumPy answer makes no sense there.
KERNEL_CHECKERS = {
    ex.check_flash_attention,
    ex.check_flash_pallas_call,
    ex.check_paged_decode_attention,
    ex.check_paged_decode_async_copy,
    ex.check_double_buffered_decode,
    ex.check_prefetching_decode,
}
ALL_EXERCISES = EXERCISES + [(checker, *rest) for checker, *rest, _ in MORE_EXERCISES]
ALL_IDS = [checker.__name__.removeprefix("check_") for checker, *_ in ALL_EXERCISES]

NUMPY_NOT_APPLICABLE = {
    ex.check_softmax_kernel: "a Pallas kernel body computes with jnp on refs",
    **{checker: "a Pallas kernel computes with jnp on refs" for checker in KERNEL_CHECKERS},
    ex.check_decode_attention: "the exercise is to vectorize in jnp: the checker runs it in jit",
}


def write_new_tokens_numpy(kv_pages, pages, kv_len, new_k, new_v):
    # A NumPy learner writes into a copy where the jnp solution uses .at[].set.
    kv_pages = np.array(kv_pages)
    n, page_size = len(new_k), kv_pages.shape[1]
    positions = kv_len - n + np.arange(n)
    page, slot = np.asarray(pages)[positions // page_size], positions % page_size
    kv_pages[page, slot, 0::2] = new_k
    kv_pages[page, slot, 1::2] = new_v
    return kv_pages


# Exercises whose jnp solution uses jnp-only functions: their NumPy solution, written apart.
NUMPY_SOLUTIONS = {ex.check_write_new_tokens: write_new_tokens_numpy}


def validator_returning_false(kv_pages, kv_lens, page_indices, num_seqs):
    return False  # a verdict returned instead of a ValueError raised


def kernel_returning_instead_of_writing(x_ref, o_ref):
    x = x_ref[...]
    e = jnp.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)  # o_ref is never written


def preempt_counting_in_a_string(request, allocator):
    allocator.free(request.pages)
    request.pages, request.num_computed = [], "0"  # a string where a count belongs


def cache_full_pages_with_text_hashes(request, pool, page_size):
    from minilib.engine.prefix_cache import hash_block_tokens

    for i in range(len(request.block_hashes), request.num_computed // page_size):
        parent = bytes.fromhex(request.block_hashes[-1]) if request.block_hashes else None
        block_hash = hash_block_tokens(parent, request.tokens[i * page_size : (i + 1) * page_size])
        pool.cache_page(request.pages[i], block_hash.hex())  # a str where the hash belongs
        request.block_hashes.append(block_hash.hex())


WRONG_TYPE = {
    ex.check_validate_page_indices: validator_returning_false,
    ex.check_preempt: preempt_counting_in_a_string,
    ex.check_cache_full_pages: cache_full_pages_with_text_hashes,
    ex.check_softmax_kernel: kernel_returning_instead_of_writing,
}


def to_numpy(x):
    """jax arrays to NumPy, through tuples, lists and dicts; anything else as it is."""
    if isinstance(x, jax.Array):
        return np.asarray(x)
    if isinstance(x, tuple | list):
        return type(x)(to_numpy(v) for v in x)
    if isinstance(x, dict):
        return {k: to_numpy(v) for k, v in x.items()}
    return x


def numpy_version(fn):
    """fn as a NumPy learner would hand it in: NumPy in, NumPy out."""

    def in_numpy(*args, **kwargs):
        return to_numpy(fn(*to_numpy(args), **to_numpy(kwargs)))

    return in_numpy


def map_leaves(x, leaf):
    if isinstance(x, tuple | list):
        return type(x)(map_leaves(v, leaf) for v in x)
    if x is None:
        return x
    return leaf(x)


def as_strings(fn):
    """The right values, as strings: '3' for 3, an array of '0.5' for an array of 0.5."""
    return lambda *a, **k: map_leaves(fn(*a, **k), lambda v: np.asarray(v).astype(str))


def as_one_element_arrays(fn):
    """Every number wrapped in a 1-element array, every array made an object array."""

    def leaf(v):
        v = np.asarray(v)
        return v.reshape(1) if v.ndim == 0 else v.astype(object)

    return lambda *a, **k: map_leaves(fn(*a, **k), leaf)


def returns_a_string(*args, **kwargs):
    return "42"


def wrong_type_answers(checker, module, name):
    if checker in WRONG_TYPE:
        return [WRONG_TYPE[checker]]
    good = solution(module, name)
    return [returns_a_string, as_strings(good), as_one_element_arrays(good)]


@pytest.mark.parametrize("checker, module, name, wrong", ALL_EXERCISES, ids=ALL_IDS)
def test_numpy_solution_passes(checker, module, name, wrong):
    if checker in NUMPY_NOT_APPLICABLE:
        pytest.skip(NUMPY_NOT_APPLICABLE[checker])
    in_numpy = NUMPY_SOLUTIONS.get(checker) or numpy_version(solution(module, name))
    result = checker(in_numpy, verbose=False)
    assert result.passed, result.report


@pytest.mark.parametrize("checker, module, name, wrong", ALL_EXERCISES, ids=ALL_IDS)
def test_wrong_type_answers_fail_with_a_message(checker, module, name, wrong):
    for answer in wrong_type_answers(checker, module, name):
        result = checker(answer, verbose=False)
        assert result.status == "failed", result.report
        assert "could not be compared" not in result.report, result.report  # a clear message
        assert any(w in result.report for w in ("expected", "got", "returned", "raised"))


@pytest.mark.parametrize("error", [SystemExit, KeyboardInterrupt, RecursionError, MemoryError])
@pytest.mark.parametrize("checker, module, name, wrong", ALL_EXERCISES, ids=ALL_IDS)
def test_any_exception_is_reported_not_raised(checker, module, name, wrong, error):
    def raising(*args, **kwargs):
        raise error("from the learner")

    result = checker(raising, verbose=False)
    assert result.status == "failed", result.report
    assert f"your function raised {error.__name__}: from the learner" in result.report
    assert 'raise error("from the learner")' in result.report  # the learner's line


@pytest.mark.parametrize("checker, module, name, wrong", ALL_EXERCISES, ids=ALL_IDS)
def test_endless_loop_is_stopped_in_time(checker, module, name, wrong, monkeypatch):
    from minilib.exercises import checking, kernel_run

    monkeypatch.setattr(checking, "TIME_LIMIT_SECONDS", 1.0)
    monkeypatch.setattr(checking, "SLOWER_THAN_REFERENCE", 2)
    monkeypatch.setattr(kernel_run, "KERNEL_TIMEOUT_SECONDS", 1.0)  # the kernel checkers'
    # A kernel checker gives a stopped run time to wind down: no kernel runs here to do so.
    monkeypatch.setattr(checking, "STOP_GRACE_SECONDS", 0.2)

    def endless(*args, **kwargs):
        while True:
            pass

    threads_before = threading.active_count()
    start = time.perf_counter()
    result = checker(endless, verbose=False)
    assert time.perf_counter() - start < 30  # the reference's compiles plus 1-2 s waits
    assert result.status == "failed"
    if checker in KERNEL_CHECKERS:  # the kernel run's own limit
        assert "expected the kernel to finish; it was stopped after 1 s" in result.report
        assert "an endless loop" in result.report
    else:
        assert "took too long: stopped after" in result.report
        assert "s (the time limit of a case)" in result.report
    # and the looping thread was stopped, not left spinning behind the check
    deadline = time.perf_counter() + 5
    while threading.active_count() > threads_before and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == threads_before


def test_endless_loop_thread_is_stopped():
    from minilib.exercises import checking

    def endless():
        while True:
            pass

    before = threading.active_count()
    finished, _, _ = checking.call_with_time_limit(endless, (), {}, 0.2)
    assert not finished
    deadline = time.perf_counter() + 5
    while threading.active_count() > before and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == before, "the looping thread should have been stopped"


def test_a_sleeping_function_does_not_hold_the_check():
    start = time.perf_counter()
    from minilib.exercises import checking

    finished, _, _ = checking.call_with_time_limit(time.sleep, (60,), {}, 0.3)
    assert not finished and time.perf_counter() - start < 2


def online_softmax_update_numpy(m, l, acc, scores, v):  # noqa: E741
    # A correct NumPy answer, as a learner writes it: the inputs may be jax arrays.
    m, l, acc, scores, v = (np.asarray(a) for a in (m, l, acc, scores, v))
    m_new = np.maximum(m, scores.max(axis=-1))
    alpha = np.exp(m - m_new)
    p = np.exp(scores - m_new[:, None])
    return m_new, alpha * l + p.sum(axis=-1), alpha[:, None] * acc + p @ v


def test_numpy_online_softmax_passes():
    result = ex.check_online_softmax_update(online_softmax_update_numpy, verbose=False)
    assert result.passed, result.report


def test_strings_and_object_arrays_do_not_crash_repeat_kv_pages():
    repeat = solution("ex01_heads", "repeat_kv_pages")
    for answer in (
        lambda kv_pages, nq: np.full(np.shape(repeat(kv_pages, nq)), "a"),
        lambda kv_pages, nq: np.asarray(repeat(kv_pages, nq)).astype(object),
        lambda kv_pages, nq: "repeated",
    ):
        result = ex.check_repeat_kv_pages(answer, verbose=False)
        assert result.status == "failed" and "numbers" in result.report, result.report
        assert "could not be compared" not in result.report


def test_check_result_shows_nothing_more_in_a_notebook():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    code = (
        "from minilib.exercises import check_live_seq_lens\n"
        "def live_seq_lens(kv_lens, cu_q_lens, num_seqs):\n"
        "    raise NotImplementedError('FILL ME IN')\n"
        "check_live_seq_lens(live_seq_lens)"
    )
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    nbclient.NotebookClient(nb, timeout=120, resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = nb.cells[0].outputs
    assert [o["output_type"] for o in outputs] == ["stream"], outputs
    assert outputs[0]["text"].startswith("Not attempted yet") and "CheckResult" not in str(outputs)


def test_check_result_still_tells_its_status():
    result = ex.check_live_seq_lens(live_seq_lens_every_slot, verbose=False)
    assert repr(result) == "CheckResult('live_seq_lens', status='failed')"
    assert result.status == "failed" and not result


# --- wrong answers that once passed, and right answers that once failed ------------------------


def seq_for_row_searchsorted_everything(cu_q_lens, num_seqs, row):
    # Searches the whole of cu_q_lens, padding included.
    return int(np.searchsorted(np.asarray(cu_q_lens)[1:], row, side="right"))


def seq_for_row_scan_ignoring_num_seqs(cu_q_lens, num_seqs, row):
    # The last start <= row, over every slot: a padding slot can win.
    cu = np.asarray(cu_q_lens)
    for i in reversed(range(len(cu) - 1)):
        if cu[i] <= row:
            return i
    return 0


def seq_for_row_last_start(cu_q_lens, num_seqs, row):
    # The last start <= row, searched over the whole array.
    return int(np.nonzero(np.asarray(cu_q_lens) <= row)[0].max())


def seq_for_row_without_idle_sequences(cu_q_lens, num_seqs, row):
    # Numbers only the sequences that have rows.
    starts = np.unique(np.asarray(cu_q_lens)[: int(num_seqs[0]) + 1])
    return int(np.searchsorted(starts[1:], row, side="right"))


def kv_blocks_window_off_by_one(first_q_pos, last_q_pos, kv_tokens_per_block, sliding_window):
    end = last_q_pos // kv_tokens_per_block + 1
    if sliding_window is None:
        return 0, end
    return max(first_q_pos - sliding_window, 0) // kv_tokens_per_block, end


def kv_blocks_window_not_clamped(first_q_pos, last_q_pos, kv_tokens_per_block, sliding_window):
    # A window reaching back past key 0 gives a negative first block.
    end = last_q_pos // kv_tokens_per_block + 1
    if sliding_window is None:
        return 0, end
    return (first_q_pos - sliding_window + 1) // kv_tokens_per_block, end


ONCE_PASSED = [
    (ex.check_seq_for_row, seq_for_row_searchsorted_everything, "padding"),
    (ex.check_seq_for_row, seq_for_row_scan_ignoring_num_seqs, "not live"),
    (ex.check_seq_for_row, seq_for_row_last_start, "not live"),
    (ex.check_seq_for_row, seq_for_row_without_idle_sequences, "idle ones counted"),
    (ex.check_kv_blocks_to_visit, kv_blocks_window_off_by_one, "the window's first key"),
    (ex.check_kv_blocks_to_visit, kv_blocks_window_not_clamped, "past key 0"),
]


def next_work_numpy_ints(seq, page, kv_lens, num_seqs, page_size):
    kv_lens = np.asarray(kv_lens)
    if (page + 1) * page_size < kv_lens[seq]:
        return np.int64(seq), np.int64(page + 1)
    later = np.nonzero(kv_lens[seq + 1 : num_seqs] > 0)[0]
    return (np.int32(seq + 1 + later[0]), np.int32(0)) if len(later) else None


def next_work_zero_d_arrays(seq, page, kv_lens, num_seqs, page_size):
    nxt = solution("ex08_ladder", "next_work")(seq, page, kv_lens, num_seqs, page_size)
    return None if nxt is None else (np.array(nxt[0]), jnp.asarray(nxt[1]))


def next_work_as_an_array(seq, page, kv_lens, num_seqs, page_size):
    nxt = solution("ex08_ladder", "next_work")(seq, page, kv_lens, num_seqs, page_size)
    return None if nxt is None else np.array(nxt)


@pytest.mark.parametrize(
    "answer", [next_work_numpy_ints, next_work_zero_d_arrays, next_work_as_an_array]
)
def test_next_work_takes_numpy_and_jax_integers(answer):
    result = ex.check_next_work(answer, verbose=False)
    assert result.passed, result.report


def can_admit_reserving_the_sampled_token(num_prompt_tokens, *, token_budget_left,
                                          num_free_pages, page_size, num_running,
                                          max_num_seqs):  # fmt: skip
    # A prompt that fits in this step also gets a page for the token sampled after it.
    first_chunk = min(num_prompt_tokens, token_budget_left)
    if num_prompt_tokens <= token_budget_left:
        first_chunk += 1
    return (num_running < max_num_seqs and token_budget_left > 0
            and -(-first_chunk // page_size) <= num_free_pages)  # fmt: skip


def can_admit_whole_prompts_only(num_prompt_tokens, *, token_budget_left, num_free_pages,
                                 page_size, num_running, max_num_seqs):  # fmt: skip
    # No chunked prefill: a prompt is admitted only if all of it runs in this step.
    return (num_running < max_num_seqs and num_prompt_tokens <= token_budget_left
            and -(-num_prompt_tokens // page_size) <= num_free_pages)  # fmt: skip


def preempt_counting_the_preemption(request, allocator):
    # The scheduler counts it too, after this returns: counted twice.
    allocator.free(request.pages)
    request.pages, request.num_computed = [], 0
    request.num_preemptions += 1


def cache_full_pages_skipping_cached_hashes(request, pool, page_size):
    # A page another request cached first is skipped, its hash never recorded: the chain
    # restarts at the next page.
    from minilib.engine.prefix_cache import hash_block_tokens

    for i in range(len(request.block_hashes), request.num_computed // page_size):
        parent = request.block_hashes[-1] if request.block_hashes else None
        block_hash = hash_block_tokens(parent, request.tokens[i * page_size : (i + 1) * page_size])
        if pool.get_cached_page(block_hash) is not None:
            continue
        pool.cache_page(request.pages[i], block_hash)
        request.block_hashes.append(block_hash)


def mask_as_floats(q_len, kv_len):
    return solution("ex03_ragged", "causal_mask")(q_len, kv_len).astype(jnp.float32)


def mask_as_list(q_len, kv_len):
    return np.asarray(solution("ex03_ragged", "causal_mask")(q_len, kv_len)).tolist()


def window_mask_as_ints(q_len, kv_len, sliding_window):
    mask = solution("ex04_reference", "sliding_window_mask")(q_len, kv_len, sliding_window)
    return np.asarray(mask).astype(np.int32)


def window_mask_as_list(q_len, kv_len, sliding_window):
    mask = solution("ex04_reference", "sliding_window_mask")(q_len, kv_len, sliding_window)
    return np.asarray(mask).tolist()


ONCE_PASSED += [  # found by learners since
    (ex.check_can_admit, can_admit_reserving_the_sampled_token, "the token sampled"),
    (ex.check_can_admit, can_admit_whole_prompts_only, "(chunked prefill)"),
    (ex.check_preempt, preempt_counting_the_preemption, "counts it twice"),
    (ex.check_cache_full_pages, cache_full_pages_skipping_cached_hashes, "restarts the chain"),
]


@pytest.mark.parametrize(
    "checker, wrong, cause", ONCE_PASSED, ids=[w.__name__ for _, w, _ in ONCE_PASSED]
)
def test_wrong_answers_that_once_passed_fail_with_their_cause(checker, wrong, cause):
    result = checker(wrong, verbose=False)
    assert result.status == "failed", result.report
    assert "Likely cause:" in result.report and cause in result.report, result.report


# (checker, a mask of the wrong type, words its report must hold): a type, not a cause.
MASKS_OF_THE_WRONG_TYPE = [
    (ex.check_causal_mask, mask_as_floats, "got an array of dtype float32"),
    (ex.check_causal_mask, mask_as_list, "got a list"),
    (ex.check_sliding_window_mask, window_mask_as_ints, "got an array of dtype int32"),
    (ex.check_sliding_window_mask, window_mask_as_list, "got a list"),
]


@pytest.mark.parametrize(
    "checker, wrong, words",
    MASKS_OF_THE_WRONG_TYPE,
    ids=[w.__name__ for _, w, _ in MASKS_OF_THE_WRONG_TYPE],
)
def test_masks_of_the_wrong_type_fail_saying_so(checker, wrong, words):
    result = checker(wrong, verbose=False)
    assert result.status == "failed", result.report
    assert words in result.report, result.report
    assert "expected a boolean jax or NumPy array" in result.report, result.report
    assert "jnp.asarray(mask, dtype=bool)" in result.report, result.report


def test_an_engine_with_skipped_hashes_differs_from_dense_generate():
    """The engine run of check_cache_full_pages, where two requests compute the same first
    page in one step, rejects the skipping answer by itself: later requests hit a page
    computed after another prefix, and their tokens are not dense_generate's."""
    from minilib.exercises.ex10_engine import run_caching_engine

    differ = "requests whose tokens differ from dense_generate's"
    right = solution("ex10_engine", "cache_full_pages")
    assert run_caching_engine(right, scenario="same prefix in one step")[differ] == []
    wrong = run_caching_engine(
        cache_full_pages_skipping_cached_hashes, scenario="same prefix in one step"
    )
    assert wrong[differ], wrong


def preempt_freeing_the_last_page_first(request, allocator):
    # Right: the order pages go back to the pool in is the function's choice.
    for page in reversed(request.pages):
        allocator.free([page])
    request.pages, request.num_computed = [], 0


def test_preempt_may_free_pages_in_any_order():
    result = ex.check_preempt(preempt_freeing_the_last_page_first, verbose=False)
    assert result.passed, result.report


# --- issue 43: wrong answers the checkers' cases let through, and one right answer they refused


def with_head_dim_scale(fn):
    """`fn` scaling by 1/sqrt(head_dim) whatever sm_scale it is given."""

    def ignoring_sm_scale(q, *args, sm_scale, **kwargs):
        return fn(q, *args, sm_scale=q.shape[-1] ** -0.5, **kwargs)

    return ignoring_sm_scale


def attend_soft_cap_by_hand(q, k, v, *, sm_scale, soft_cap, q_from_zero=False,
                            cap_before_scale=False):  # fmt: skip
    q_len, num_q_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    k, v = (jnp.repeat(x, num_q_heads // num_kv_heads, axis=1) for x in (k, v))
    scores = jnp.einsum("qhd,khd->hqk", q, k)
    if soft_cap is not None and cap_before_scale:  # caps q·k, then scales
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = scores * sm_scale
    if soft_cap is not None and not cap_before_scale:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    # q_from_zero: q row i at position i, not kv_len - q_len + i
    q_pos = (0 if q_from_zero else kv_len - q_len) + jnp.arange(q_len)[:, None]
    scores = jnp.where(jnp.arange(kv_len)[None, :] > q_pos, -1e30, scores)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v)


def can_admit_sampled_token_in_the_chunk(num_prompt_tokens, *, token_budget_left,
                                         num_free_pages, page_size, num_running,
                                         max_num_seqs):  # fmt: skip
    # The token sampled after the prompt counted in the first chunk, when the budget has room.
    first_chunk = min(num_prompt_tokens + 1, token_budget_left)
    return (num_running < max_num_seqs and token_budget_left > 0
            and -(-first_chunk // page_size) <= num_free_pages)  # fmt: skip


def preempt_resetting_the_count(request, allocator):
    # Resets the count: right after a first preemption, wrong after a second.
    allocator.free(request.pages)
    request.pages, request.num_computed, request.num_preemptions = [], 0, 0


ONCE_PASSED_43 = [
    (ex.check_grouped_query_attention,
     with_head_dim_scale(solution("ex01_heads", "grouped_query_attention")), "1 / sqrt(head_dim)"),
    (ex.check_attend_soft_cap, with_head_dim_scale(solution("ex04_reference", "attend_soft_cap")),
     "1 / sqrt(head_dim)"),
    (ex.check_decode_attention,
     with_head_dim_scale(solution("ex06_vectorized", "decode_attention")), "1 / sqrt(head_dim)"),
    (ex.check_attend_soft_cap,
     functools.partial(attend_soft_cap_by_hand, q_from_zero=True), "the *last* q_len positions"),
    (ex.check_attend_soft_cap,
     functools.partial(attend_soft_cap_by_hand, cap_before_scale=True),
     "the soft cap is applied before sm_scale"),
    (ex.check_can_admit, can_admit_sampled_token_in_the_chunk, "the token sampled"),
    (ex.check_preempt, preempt_resetting_the_count, "setting it to 0 forgets them"),
]  # fmt: skip


@pytest.mark.parametrize(
    "checker, wrong, cause",
    ONCE_PASSED_43,
    ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(ONCE_PASSED_43)],
)
def test_wrong_answers_of_issue_43_fail_with_their_cause(checker, wrong, cause):
    result = checker(wrong, verbose=False)
    assert result.status == "failed", result.report
    assert "Likely cause:" in result.report and cause in result.report, result.report


def test_the_right_answer_never_sees_sm_scale_equal_to_its_usual_value():
    """Every checker of a function taking sm_scale draws values other than head_dim ** -0.5."""
    from minilib.exercises import ex07_flash, ex08_ladder

    for case in [*ex07_flash._cases(0), *ex08_ladder._decode_cases(0)]:
        head_dim = case.args[0].shape[-1]
        assert abs(case.kwargs["sm_scale"] - head_dim**-0.5) > 0.01, case.description


def online_softmax_zeroing_masked_keys(m, l, acc, scores, v):  # noqa: E741
    # Right, defensively: a masked key weighs 0, so a fully masked first block leaves l = 0,
    # acc = 0 (minilib's leaves l = the block's size: each masked key weighs exp(0) there).
    m_new = jnp.maximum(m, scores.max(axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(scores > -1e30, jnp.exp(scores - m_new[:, None]), 0.0)
    return m_new, alpha * l + p.sum(-1), alpha[:, None] * acc + p @ v


def online_softmax_masked_keys_out_of_the_max(m, l, acc, scores, v):  # noqa: E741
    # Right too: masked keys out of the max as well, so m stays -inf on a fully masked block.
    visible = scores > -1e30
    m_new = jnp.maximum(m, jnp.where(visible, scores, -jnp.inf).max(axis=-1))
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - shift), 0.0)
    p = jnp.where(visible, jnp.exp(scores - shift[:, None]), 0.0)
    return m_new, alpha * l + p.sum(-1), alpha[:, None] * acc + p @ v


@pytest.mark.parametrize(
    "answer", [online_softmax_zeroing_masked_keys, online_softmax_masked_keys_out_of_the_max]
)
def test_online_softmax_accepts_any_state_of_a_row_that_saw_only_masked_keys(answer):
    result = ex.check_online_softmax_update(answer, verbose=False)
    assert result.passed, result.report

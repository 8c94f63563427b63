"""The exercises the checker tests run over: each checker with its worked solution in
`solutions/` and a plausible wrong answer, a mistake learners make."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import one_case_per_path
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from ladder_wrong_answers import flash_call, rung6, rung7

import minilib.exercises as ex
from minilib.ladder.flash import init_online_softmax

ROOT = Path(__file__).resolve().parents[1]


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

    for i in range(len(request.cached_hashes), request.num_computed // page_size):
        parent = request.cached_hashes[-1] if request.cached_hashes else None
        block_hash = hash_block_tokens(parent, request.tokens[i * page_size : (i + 1) * page_size])
        pool.cache_page(request.pages[i], block_hash)
        pool.touch([request.pages[i]])
        request.cached_hashes.append(block_hash)


def verify_drafts_without_bonus(probs, drafts, uniforms, sample):
    # Every draft kept, and nothing more: the bonus token of the last row is missing.
    tokens = []
    for i, draft in enumerate(drafts):
        if uniforms[i] >= probs[i, draft]:
            residual = probs[i].copy()
            residual[draft] = 0.0
            return [*tokens, sample(residual / residual.sum())]
        tokens.append(int(draft))
    return tokens


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
    (ex.check_prefill_chunk, "ex08_ladder", "prefill_chunk_attention", rung6("no_kv_offset")),
    (ex.check_ragged_paged_attention, "ex08_ladder", "ragged_paged_attention", rung7("no_reset")),
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
    (ex.check_verify_drafts, "ex10_engine", "verify_drafts", verify_drafts_without_bonus),
]
IDS = [checker.__name__.removeprefix("check_") for checker, *_ in EXERCISES]


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
                                    num_queries_per_block, padded_slot):  # fmt: skip
    # Forgets that the KV block is double-buffered: one slot per page.
    kvh, rows = num_kv_heads_per_block, num_queries_per_block * group

    def vmem(pages):
        tokens = pages * page_size
        slot = tokens * (2 * kvh + 2 * padded_slot) * head_dim * itemsize
        q_out_fold = 5 * kvh * rows * head_dim * itemsize
        state = kvh * rows * (256 + head_dim) * 4
        return slot + q_out_fold + state + kvh * rows * -(-tokens // 128) * 128 * 4

    pages = 0
    while pages < pages_per_seq and vmem(pages + 1) <= vmem_budget_bytes:
        pages += 1
    return pages


def num_kv_pages_per_block_without_spills(vmem_budget_bytes, *, page_size, pages_per_seq,
                                          num_kv_heads_per_block, group, head_dim, itemsize,
                                          num_queries_per_block, padded_slot):  # fmt: skip
    # Adds up the kernel's own buffers and leaves out what Mosaic spills.
    kvh, rows = num_kv_heads_per_block, num_queries_per_block * group

    def vmem(pages):
        slot = 2 * pages * page_size * (2 * kvh + 2 * padded_slot) * head_dim * itemsize
        return slot + 5 * kvh * rows * head_dim * itemsize + kvh * rows * (256 + head_dim) * 4

    pages = 0
    while pages < pages_per_seq and vmem(pages + 1) <= vmem_budget_bytes:
        pages += 1
    return pages


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
    (
        ex.check_num_kv_pages_per_block,
        "ex09_performance",
        "num_kv_pages_per_block",
        num_kv_pages_per_block_without_spills,
        "the spills",
    ),
]


# The checkers of Pallas kernels (minilib.exercises.kernel_checking): their kernel run has a
# time limit of its own, and a NumPy answer makes no sense there.
KERNEL_CHECKERS = {
    ex.check_flash_attention,
    ex.check_flash_pallas_call,
    ex.check_paged_decode_attention,
    ex.check_paged_decode_async_copy,
    ex.check_double_buffered_decode,
    ex.check_prefetching_decode,
    ex.check_prefill_chunk,
    ex.check_ragged_paged_attention,
}
ALL_EXERCISES = EXERCISES + [(checker, *rest) for checker, *rest, _ in MORE_EXERCISES]
ALL_IDS = [checker.__name__.removeprefix("check_") for checker, *_ in ALL_EXERCISES]


def first_and_first_kernel(exercises, ids):
    """The exercises as pytest params for a sweep that every checker shares: the first
    exercise and the first kernel exercise run on every stack, the others once, in .venv
    (marked `matrix`, conftest's `one_case_per_path`)."""
    params = [pytest.param(*exercise, id=id_) for exercise, id_ in zip(exercises, ids, strict=True)]
    first_kernel = next(p.id for p in params if p.values[0] in KERNEL_CHECKERS)
    return one_case_per_path(params, ids[0], first_kernel)

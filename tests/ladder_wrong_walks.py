"""The wrong kernels of the ladder's last rungs, as a learner writes them: rung 5 (prefetching
across grid steps), 5a (`next_work` in Python), 6 (a prefill chunk) and 7 (the ragged batch).
Each maker starts from the solution and changes one thing, the `variant`, commented with the
mistake it makes; `ladder_wrong_answers.WRONG_ANSWERS` lists them with their checkers. One
variant of rung 6 is right: "floor_division" counts pages and KV blocks with `//` on traced
integers where the solution has `pl.cdiv` (tests/exercises/test_kernel_constructs.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.ladder import double_buffer, prefetch, prefill_chunk, ragged
from minilib.ladder.flash import init_online_softmax
from minilib.ladder.prefetch import next_seq_with_pages
from minilib.ladder.prefill_chunk import KVBlockCopy, attend_rows, write_rows
from minilib.ladder.ragged import next_seq_with_rows
from minilib.ladder.scalar_prefetch import attend_kv_block, write_output

# --- rung 5: prefetching across grid steps -----------------------------------------------------


def rung5(variant: str) -> Callable:
    def kernel(kv_lens_ref, page_indices_ref, q_ref, kv_hbm_ref, o_ref, bufs, sems, slot_ref,
               m_ref, l_ref, acc_ref, *, sm_scale):  # fmt: skip
        seq, num_seqs = pl.program_id(0), pl.num_programs(0)
        kv_len, page_size = kv_lens_ref[seq], bufs.shape[1]

        def page_copy(s, i, slot):
            page = page_indices_ref[s, i]
            return pltpu.make_async_copy(kv_hbm_ref.at[page], bufs.at[slot], sems.at[slot])

        first_step = seq >= 0 if variant == "first_copy_every_step" else seq == 0

        @pl.when(first_step)
        def _first():
            slot_ref[0] = 0
            first = next_seq_with_pages(0, kv_lens_ref, num_seqs)
            if variant == "first_copy_of_seq_0":  # seq 0 even when it is an empty slot
                first = 0

            @pl.when(first < num_seqs)
            def _():
                page_copy(first, 0, 0).start()

        def body(i, slot):
            if variant == "le_for_lt":  # <= : a page past the last one of a whole-page sequence
                more_pages = (i + 1) * page_size <= kv_len
            else:
                more_pages = (i + 1) * page_size < kv_len
            if variant == "no_skip_empty":  # the next slot even if it is empty
                later = seq + 1
            else:
                later = next_seq_with_pages(seq + 1, kv_lens_ref, num_seqs)
            next_seq = jnp.where(more_pages, seq, later)
            next_page = jnp.where(more_pages, i + 1, 0)
            has_next = more_pages | (later < num_seqs)
            if variant == "next_past_the_last":  # forgets that the last sequence has no next
                has_next = jnp.bool_(True)
            into = slot if variant == "next_into_same_slot" else 1 - slot

            @pl.when(has_next)
            def _():
                page_copy(jnp.minimum(next_seq, num_seqs - 1) if variant != "next_past_the_last"
                          else next_seq, next_page, into).start()  # fmt: skip

            page_copy(seq, i, slot).wait()
            attend_kv_block(bufs.at[slot], q_ref, m_ref, l_ref, acc_ref, i * page_size, kv_len,
                            sm_scale)  # fmt: skip
            return 1 - slot

        init_online_softmax(m_ref, l_ref, acc_ref)
        start = 0 if variant == "slot_not_carried" else slot_ref[0]
        slot_ref[0] = lax.fori_loop(0, pl.cdiv(kv_len, page_size), body, start)
        write_output(o_ref, l_ref, acc_ref)

    return functools.partial(prefetch.paged_decode_attention_prefetch, kernel=kernel)


def rung5_no_prefetch_across_steps() -> Callable:
    """Rung 4's kernel in rung 5's call: every grid step starts its own first page."""

    def kernel(kv_lens_ref, page_indices_ref, q_ref, kv_hbm_ref, o_ref, bufs, sems, slot_ref,
               m_ref, l_ref, acc_ref, *, sm_scale):  # fmt: skip
        del slot_ref
        double_buffer.double_buffer_kernel(kv_lens_ref, page_indices_ref, q_ref, kv_hbm_ref,
                                           o_ref, bufs, sems, m_ref, l_ref, acc_ref,
                                           sm_scale=sm_scale)  # fmt: skip

    return functools.partial(prefetch.paged_decode_attention_prefetch, kernel=kernel)


# --- rung 5a: next_work in Python ----------------------------------------------------------------


def next_work_variant(variant: str) -> Callable:
    def next_work(seq, page, kv_lens, num_seqs, page_size):
        if variant == "le_for_lt":
            if (page + 1) * page_size <= kv_lens[seq]:
                return seq, page + 1
        elif (page + 1) * page_size < kv_lens[seq]:
            return seq, page + 1
        if variant == "stops_at_sequence_end":
            return None
        seq += 1
        while variant != "no_skip_empty" and seq < num_seqs and kv_lens[seq] == 0:
            seq += 1
        live = len(kv_lens) if variant == "ignores_num_seqs" else num_seqs  # padding too
        while variant == "ignores_num_seqs" and seq < live and kv_lens[seq] == 0:
            seq += 1
        return (seq, 0) if seq < live else None

    return next_work


# --- rungs 6 and 7: KV blocks of several pages, the ragged walk ------------------------------


def kv_block(page_indices_ref, kv_hbm_ref, bufs, sems, seq, kv_len, b, slot, variant=""):
    page_size = kv_hbm_ref.shape[1]
    per_block, last = bufs.shape[1] // page_size, pl.cdiv(kv_len, page_size) - 1
    if variant == "pages_per_block_tokens":  # bufs.shape[1] is block_kv tokens, not pages
        per_block = bufs.shape[1]
    if variant == "two_pages_per_block":  # hard-coded: the first cases' value, not bufs' shape
        per_block = 2
    if variant == "floor_division":  # right: the same last page, `//` on a traced integer
        last = (kv_len + page_size - 1) // page_size - 1
    first = b + 0 if variant == "page_b_plus_p" else b * per_block  # b + p: blocks overlap
    pages = [
        page_indices_ref[
            seq,
            first + p
            if variant == "pages_unclamped"  # garbage entries
            else jnp.minimum(first + p, last),
        ]
        for p in range(per_block)
    ]
    copy = KVBlockCopy(kv_hbm_ref, bufs, sems, pages, slot)
    if variant == "all_pages_to_place_0":  # every page of a block into the slot's first place

        class FirstPlace(KVBlockCopy):
            def start(self):
                for page in self.pages:
                    place = self.bufs.at[self.slot, pl.ds(0, page_size)]
                    pltpu.make_async_copy(
                        self.kv_pages_hbm_ref.at[page], place, self.sems.at[self.slot]
                    ).start()

        copy = FirstPlace(kv_hbm_ref, bufs, sems, pages, slot)
    return copy


def rung6(variant: str) -> Callable:
    def kernel(
        kv_lens_ref,
        page_indices_ref,
        q_lens_ref,
        q_ref,
        kv_hbm_ref,
        o_ref,
        bufs,
        sems,
        m_ref,
        l_ref,
        acc_ref,
        *,
        sm_scale,
    ):
        seq, i = pl.program_id(0), pl.program_id(1)
        if variant == "head_dim_scale":  # 1/sqrt(head_dim), not the sm_scale it is given
            sm_scale = q_ref.shape[-1] ** -0.5
        kv_len, q_len = kv_lens_ref[seq], q_lens_ref[seq]
        block_q, block_kv = q_ref.shape[0], bufs.shape[1]
        first_row = i * block_q
        row = lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        q_pos = {
            "no_kv_offset": first_row + row,  # forgets kv_len - q_len
            "no_block_offset": kv_len - q_len + row,  # forgets first_row
            "causal_minus_one": kv_len - q_len + first_row + row - 1,  # hides its own key
            "causal_plus_one": kv_len - q_len + first_row + row + 1,  # sees the next key
        }.get(variant, kv_len - q_len + first_row + row)
        if variant == "no_sm_scale":  # the scores never scaled
            sm_scale = 1.0
        last_row = jnp.minimum(first_row + block_q, q_len) - 1
        if variant == "last_row_unclamped":  # the q block's last row, live or not
            last_row = first_row + block_q - 1
        if variant == "blocks_from_first_row":  # the first row's diagonal, not the last's
            last_row = first_row
        num_kv_blocks = pl.cdiv(kv_len - q_len + last_row + 1, block_kv)
        if variant == "floor_division":  # right: the same count, `//` on traced integers
            num_kv_blocks = (kv_len - q_len + last_row + block_kv) // block_kv
        if variant == "no_diagonal_skip":  # every KV block up to kv_len
            num_kv_blocks = pl.cdiv(kv_len, block_kv)
        if variant == "kv_blocks_floor":  # floor: the last, partial KV block is lost
            num_kv_blocks = (kv_len - q_len + last_row + 1) // block_kv
        if variant != "dead_q_block_not_skipped":  # a q block with no live row: nothing
            num_kv_blocks = jnp.where(first_row < q_len, num_kv_blocks, 0)

        def copy(b, slot):
            return kv_block(page_indices_ref, kv_hbm_ref, bufs, sems, seq, kv_len, b, slot, variant)

        def body(b, _):
            slot = b % 2
            into = slot if variant == "next_into_same_slot" else 1 - slot
            if variant == "single_buffered":  # rung 3's loop in slot 0: start, wait, compute
                copy(b, 0).start()
                copy(b, 0).wait()
                attend_rows(
                    bufs.at[0], q_ref, m_ref, l_ref, acc_ref, b * block_kv, q_pos, kv_len, sm_scale
                )
                return
            if variant == "no_overlap":  # block b started here, after block b - 1's wait
                copy(b, slot).start()
            elif variant == "next_after_wait":  # block b + 1 started after block b's wait
                copy(b, slot).wait()
                pl.when(b + 1 < num_kv_blocks)(lambda: copy(b + 1, into).start())
            else:
                pl.when(b + 1 < num_kv_blocks)(lambda: copy(b + 1, into).start())
            if variant != "next_after_wait":
                copy(b, slot).wait()
            attend_rows(
                bufs.at[slot], q_ref, m_ref, l_ref, acc_ref, b * block_kv, q_pos, kv_len, sm_scale
            )

        if variant != "no_init":  # scratch starts as NaN
            init_online_softmax(m_ref, l_ref, acc_ref)
        if variant == "first_copy_unguarded":  # block 0 even with no KV block to visit
            copy(0, 0).start()
        elif variant not in ("no_overlap", "single_buffered"):
            pl.when(num_kv_blocks > 0)(lambda: copy(0, 0).start())
        lax.fori_loop(0, num_kv_blocks, body, None)
        write_rows(o_ref, l_ref, acc_ref)

    return functools.partial(prefill_chunk.prefill_chunk_attention, kernel=kernel)


def rung7(variant: str) -> Callable:
    def kernel(
        kv_lens_ref,
        page_indices_ref,
        cu_q_lens_ref,
        num_seqs_ref,
        q_ref,
        kv_hbm_ref,
        o_ref,
        bufs,
        sems,
        slot_ref,
        m_ref,
        l_ref,
        acc_ref,
        *,
        sm_scale,
        mask_value,
    ):
        q_blk, num_q_blks, num_seqs = pl.program_id(0), pl.num_programs(0), num_seqs_ref[0]
        if variant == "head_dim_scale":  # 1/sqrt(head_dim), not the sm_scale it is given
            sm_scale = q_ref.shape[-1] ** -0.5
        if variant == "ignores_num_seqs":  # walks the padding slots too
            num_seqs = kv_lens_ref.shape[0]
        block_q, block_kv = q_ref.shape[0], bufs.shape[1]
        first_row, end_row = q_blk * block_q, (q_blk + 1) * block_q
        cu = cu_q_lens_ref

        def num_kv_blocks(seq):
            last_row = jnp.minimum(cu[seq + 1], end_row) - 1
            if variant == "blocks_to_q_end":  # the sequence's last row, in whichever q block
                last_row = cu[seq + 1] - 1
            q_len = cu[seq + 1] - cu[seq]
            last_pos = kv_lens_ref[seq] - q_len + last_row - cu[seq]
            if variant == "kv_blocks_floor":  # floor: the last, partial KV block is lost
                return (last_pos + 1) // block_kv
            if variant == "cdiv_without_plus_one":  # a count of positions is last_pos + 1
                return pl.cdiv(last_pos, block_kv)
            return pl.cdiv(last_pos + 1, block_kv)

        def copy(seq, b, slot):
            return kv_block(
                page_indices_ref, kv_hbm_ref, bufs, sems, seq, kv_lens_ref[seq], b, slot, variant
            )

        def next_seq(seq):  # the next sequence with rows
            if variant in ("walk_no_skip_idle", "next_no_skip_idle"):  # q_len 0 too
                return seq + 1
            return next_seq_with_rows(seq + 1, cu[seq + 1], cu, num_seqs)

        def next_work(seq, b):
            more = (
                (b + 1 <= num_kv_blocks(seq))
                if variant == "le_for_lt"
                else (b + 1 < num_kv_blocks(seq))
            )
            later = (
                next_seq(seq)
                if variant != "walk_no_skip_idle"
                else next_seq_with_rows(seq + 1, cu[seq + 1], cu, num_seqs)
            )
            later_here = (later < num_seqs) & (cu[jnp.minimum(later, num_seqs)] < end_row)
            start = seq + 1 if variant == "next_block_skips_seq" else seq  # may be seq itself
            next_blk = next_seq_with_rows(start, end_row, cu, num_seqs)
            in_next_blk = (q_blk + 1 < num_q_blks) & (next_blk < num_seqs)
            if variant in ("no_prefetch_across_steps", "next_blk_never_started"):
                in_next_blk = jnp.bool_(False)  # the next q block's first: not from here
            has_next = more | later_here | in_next_blk
            if variant == "next_past_the_last":
                has_next = jnp.bool_(True)
            nxt = jnp.where(more, seq, jnp.where(later_here, later, next_blk))
            if variant == "next_branches_swapped":  # the next q block before this one's next
                nxt = jnp.where(more, seq, jnp.where(in_next_blk, next_blk, later))
            return has_next, jnp.minimum(nxt, kv_lens_ref.shape[0] - 1), jnp.where(more, b + 1, 0)

        def attend_seq(seq, slot):
            q_start, kv_len = cu[seq], kv_lens_ref[seq]
            q_len = cu[seq + 1] - q_start
            row = first_row + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
            local = lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)  # without first_row
            if variant == "row_no_first_row":  # the row's place in its q block, for both
                row = local
            rows = (q_start <= row) & (row < q_start + q_len)
            if variant == "rows_block_local":  # the row mask from the q block's own rows
                rows = (q_start <= local) & (local < q_start + q_len)
            q_pos = {
                "no_kv_offset": row - q_start,
                "global_row": kv_len - q_len + row,
                "q_pos_from_q_block": kv_len - q_len + local,  # counts from the q block
                "q_pos_no_first_row": kv_len - q_len + local - q_start,
                "causal_plus_one": kv_len - q_len + row - q_start + 1,  # sees the next key
                "causal_minus_one": kv_len - q_len + row - q_start - 1,  # hides its own key
            }.get(variant, kv_len - q_len + row - q_start)
            if variant == "no_sm_scale":  # the scores never scaled
                scale = 1.0
            else:
                scale = sm_scale

            def body(b, slot):
                has_next, nseq, nb = next_work(seq, b)
                into = slot if variant == "next_into_same_slot" else 1 - slot
                if variant == "next_after_wait":  # the next copy started after this wait
                    copy(seq, b, slot).wait()
                pl.when(has_next)(lambda: copy(nseq, nb, into).start())
                if variant != "next_after_wait":
                    copy(seq, b, slot).wait()
                attend_rows(
                    bufs.at[slot],
                    q_ref,
                    m_ref,
                    l_ref,
                    acc_ref,
                    b * block_kv,
                    q_pos,
                    kv_len,
                    scale,
                    # ignores mask_value: attend_rows' default, whatever the call was given
                    *(() if variant == "ignores_mask_value" else (mask_value,)),
                )
                return 1 - slot

            if variant != "no_reset":
                init_online_softmax(m_ref, l_ref, acc_ref)
            slot = lax.fori_loop(0, num_kv_blocks(seq), body, slot)
            write_rows(o_ref, l_ref, acc_ref, None if variant == "no_row_mask" else rows)
            return slot

        if variant == "no_reset":  # once per q block only
            init_online_softmax(m_ref, l_ref, acc_ref)
        first_step = q_blk >= 0 if variant == "first_copy_every_step" else q_blk == 0

        @pl.when(first_step)
        def _():
            slot_ref[0] = 0
            first = next_seq_with_rows(
                0,
                first_row
                if variant in ("first_copy_every_step", "no_prefetch_across_steps")
                else 0,
                cu,
                num_seqs,
            )
            pl.when(first < num_seqs)(lambda: copy(first, 0, 0).start())

        if variant == "no_prefetch_across_steps":  # each grid step starts its own first copy

            @pl.when(q_blk > 0)
            def _():
                slot_ref[0] = 0
                first = next_seq_with_rows(0, first_row, cu, num_seqs)
                pl.when(first < num_seqs)(lambda: copy(first, 0, 0).start())

        def has_rows_here(carry):
            seq, _ = carry
            if variant == "walk_past_end_row":  # <=: a sequence starting at end_row too
                return (seq < num_seqs) & (cu[jnp.minimum(seq, num_seqs)] <= end_row)
            if variant == "skip_spanning_seq":  # only sequences that end in this q block
                return (seq < num_seqs) & (cu[jnp.minimum(seq + 1, num_seqs)] <= end_row)
            return (seq < num_seqs) & (cu[jnp.minimum(seq, num_seqs)] < end_row)

        def walk(carry):
            seq, slot = carry
            slot = attend_seq(seq, slot)
            return next_seq(seq), slot

        first = next_seq_with_rows(
            0, 0 if variant == "walk_from_seq_0" else first_row, cu, num_seqs
        )
        start = 0 if variant == "slot_not_carried" else slot_ref[0]
        _, slot_ref[0] = lax.while_loop(has_rows_here, walk, (first, start))

    return functools.partial(ragged.ragged_paged_attention_ladder, kernel=kernel)

"""Wrong answers that once passed their checkers, each kept so that it stays rejected: the
exercise's checker, the answer, and words its report must contain."""

from __future__ import annotations

import numpy as np

import minilib.exercises as ex


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

    for i in range(len(request.cached_hashes), request.num_computed // page_size):
        parent = request.cached_hashes[-1] if request.cached_hashes else None
        block_hash = hash_block_tokens(parent, request.tokens[i * page_size : (i + 1) * page_size])
        if pool.get_cached_page(block_hash) is not None:
            continue
        pool.cache_page(request.pages[i], block_hash)
        request.cached_hashes.append(block_hash)


ONCE_PASSED += [  # found by learners since
    (ex.check_can_admit, can_admit_reserving_the_sampled_token, "the token sampled"),
    (ex.check_can_admit, can_admit_whole_prompts_only, "(chunked prefill)"),
    (ex.check_preempt, preempt_counting_the_preemption, "counts it twice"),
    (ex.check_cache_full_pages, cache_full_pages_skipping_cached_hashes, "restarts the chain"),
]

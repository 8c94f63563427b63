"""One step's sequences packed into the fixed-size arrays the model and attention read.

`pack_batch` lays the step's sequences out one after another (prefill chunks, decode tokens
and, with speculative decoding, each decoding sequence's last token and its drafts) and pads
every array to the sizes it is given: T token rows and S sequence slots, the step's buckets
(`minilib.engine.buckets`). Padding is idle: a padding row writes its K/V to page
`num_pages`, which the scatter drops, and a padding slot has q_len 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from minilib.engine.scheduler import StepPlan

__all__ = ["PackedBatch", "pack_batch"]


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One step's inputs, padded to fixed sizes: T = max_num_batched_tokens rows,
    S = max_num_seqs slots, k = num_speculative_tokens.

    >>> from minilib.engine.scheduler import StepPlan
    >>> empty = pack_batch(StepPlan((), (), ()), max_num_batched_tokens=4, max_num_seqs=2,
    ...                    num_pages=3, page_size=4)
    >>> empty.page_ids.tolist(), empty.cu_q_lens.tolist(), empty.num_seqs.tolist()  # all padding
    ([3, 3, 3, 3], [0, 0, 0], [0])
    """

    tokens: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T], each row's position in its sequence
    page_ids: np.ndarray  # i32[T], where each row's K/V goes (num_pages for padding: dropped)
    slot_ids: np.ndarray  # i32[T]
    kv_lens: np.ndarray  # i32[S]
    page_indices: np.ndarray  # i32[S, pages_per_seq]
    cu_q_lens: np.ndarray  # i32[S + 1]
    num_seqs: np.ndarray  # i32[1]
    sample_rows: np.ndarray  # i32[S, k + 1]: the rows whose logits pick each one's tokens
    drafts: np.ndarray  # i32[S, k], the drafts those rows verify
    num_drafts: np.ndarray  # i32[S]

    @property
    def num_tokens(self) -> int:
        """The real token rows: the rest is padding."""
        return int(self.cu_q_lens[self.num_seqs[0]])


def pack_batch(
    plan: StepPlan,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    num_pages: int,
    page_size: int,
    num_speculative_tokens: int = 0,
) -> PackedBatch:
    """Lay the step's sequences out one after another: prefill chunks and decode tokens of
    many requests in one ragged batch, padded to max_num_batched_tokens rows and
    max_num_seqs slots.

    A sequence's `sample_rows` are its last row, or with d drafts its last d + 1 rows (the
    last sampled token's and each draft's), then its last row repeated: row j's logits give
    the token after the first j drafts.

    >>> from minilib.engine.scheduler import Request, StepPlan, schedule_tokens
    >>> a = Request(0, prompt=[5, 6, 7], max_new_tokens=1, pages=[3])
    >>> b = Request(1, prompt=[8], max_new_tokens=4, output=[9], pages=[0], num_computed=1)
    >>> plan = StepPlan((schedule_tokens(a, 3), schedule_tokens(b, 3, drafts=(8, 9))), (), ())
    >>> batch = pack_batch(plan, max_num_batched_tokens=8, max_num_seqs=3, num_pages=4,
    ...                    page_size=4, num_speculative_tokens=2)
    >>> batch.tokens.tolist(), batch.positions.tolist()   # b: 9, then drafts 8 and 9
    ([5, 6, 7, 9, 8, 9, 0, 0], [0, 1, 2, 1, 2, 3, 0, 0])
    >>> batch.page_ids.tolist()
    [3, 3, 3, 0, 0, 0, 4, 4]
    >>> batch.kv_lens.tolist(), batch.cu_q_lens.tolist(), batch.num_seqs.tolist()
    ([3, 4, 0], [0, 3, 6, 6], [2])
    >>> batch.sample_rows.tolist(), batch.num_drafts.tolist()
    ([[2, 2, 2], [3, 4, 5], [0, 0, 0]], [0, 2, 0])
    """
    t, s, k = max_num_batched_tokens, max_num_seqs, num_speculative_tokens
    tokens, positions = np.zeros(t, np.int32), np.zeros(t, np.int32)
    page_ids, slot_ids = np.full(t, num_pages, np.int32), np.zeros(t, np.int32)
    kv_lens, cu_q_lens = np.zeros(s, np.int32), np.zeros(s + 1, np.int32)
    page_indices = np.zeros((s, num_pages), np.int32)
    sample_rows, drafts = np.zeros((s, k + 1), np.int32), np.zeros((s, k), np.int32)
    num_drafts = np.zeros(s, np.int32)
    for i, seq in enumerate(plan.seqs):
        row, end = cu_q_lens[i], cu_q_lens[i] + seq.num_tokens
        d = len(seq.draft_token_ids)
        new_positions = np.arange(seq.start, seq.start + seq.num_tokens)
        tokens[row : end - d] = seq.request.tokens[seq.start : seq.start + seq.num_tokens - d]
        tokens[end - d : end] = seq.draft_token_ids
        positions[row:end] = new_positions
        pages = np.asarray(seq.request.pages, np.int32)
        page_ids[row:end] = pages[new_positions // page_size]  # token t: page t // page_size
        slot_ids[row:end] = new_positions % page_size  # ... at slot t % page_size
        kv_lens[i] = seq.start + seq.num_tokens
        page_indices[i, : len(pages)] = pages
        cu_q_lens[i + 1] = end
        sample_rows[i] = np.minimum(end - 1 - d + np.arange(k + 1), end - 1)
        drafts[i, :d], num_drafts[i] = seq.draft_token_ids, d
    cu_q_lens[len(plan.seqs) + 1 :] = cu_q_lens[len(plan.seqs)]
    num_seqs = np.array([len(plan.seqs)], np.int32)
    return PackedBatch(
        tokens,
        positions,
        page_ids,
        slot_ids,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sample_rows,
        drafts,
        num_drafts,
    )

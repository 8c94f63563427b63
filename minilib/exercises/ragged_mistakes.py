"""The usual mistakes of rungs 6 and 7, made on purpose in numpy: a wrong output that matches
one of them is named for it (`minilib.exercises.kernel_failures.likely_cause`).

Each mistake is the kernel's own walk, row by row, with one thing changed: the position of a
row (`q_pos`), which rows a sequence writes, whether the softmax state starts again for each
sequence. The KV blocks visited are the right ones (a wrong count shows in the copies first).
"""

from __future__ import annotations

import numpy as np

from minilib.exercises.checking import SM_SCALE_IGNORED
from minilib.kv_cache import pages_needed

__all__ = ["prefill", "prefill_mistakes", "ragged", "ragged_mistakes"]

NO_KV_OFFSET = (
    "the causal offset `kv_len - q_len` is missing from q_pos: the chunk is the *last* q_len "
    "tokens of the sequence, so its row r sits at position kv_len - q_len + r."
)


NO_SM_SCALE = (
    "the scores are not scaled: multiply q @ k.T by the sm_scale the kernel is given "
    "(`attend_rows(..., sm_scale)`)."
)
CAUSAL_PLUS_ONE = (
    "the causal offset is one too many: each row sees the key after its own. Row r of the "
    "chunk sits at position kv_len - q_len + r (no + 1), and sees the keys k_pos <= q_pos."
)
CAUSAL_MINUS_ONE = (
    "the causal offset is one too few: each row misses its own key. Row r of the chunk sits "
    "at position kv_len - q_len + r (no - 1), and sees the keys k_pos <= q_pos."
)
ROWS_BLOCK_LOCAL = (
    "the row mask compares the row's place in its q block (0 .. block_q - 1) with q_start "
    "and q_start + q_len, not its place in the batch: in a q block past the first, a sequence "
    "then leaves its own rows unwritten (they keep what the output block held from the grid "
    "step before) or writes its output into rows past its end. Build the mask from row = "
    "first_row + iota: rows = (q_start <= row) & (row < q_start + q_len)."
)
ROW_NO_FIRST_ROW = (
    "first_row is missing from `row`: row r of q block i is row `first_row + r` of the "
    "batch, so row = first_row + iota. Without it both the row mask and q_pos count from the "
    "q block: in a q block past the first, a sequence leaves its own rows unwritten (they "
    "keep what the output block held from the grid step before) or writes rows with the "
    "wrong q_pos. With row = first_row + iota: rows = (q_start <= row) & (row < q_start + "
    "q_len), and q_pos = kv_len - q_len + row - q_start."
)


def _keys(kv_pages, table, seq: int, kv_len: int):
    """K and V of a sequence's first kv_len tokens, float64 [kv_len, num_kv_heads, head_dim]."""
    page_size, combined, head_dim = kv_pages.shape[1:]
    pages = table[seq, : pages_needed(kv_len, page_size)]
    kv = np.asarray(kv_pages, np.float64)[pages].reshape(-1, combined, head_dim)[:kv_len]
    return kv[:, 0::2], kv[:, 1::2]


def _attend(q_row, keys: list, sm_scale: float, mask_value: float | None = None):
    """One row's attention over the keys of `keys` [(k, v, visible)], 0 if none visible.
    mask_value None: the hidden keys weigh nothing; else a hidden key's score *is* mask_value
    (as `attend_rows` sets it), its V zero past kv_len (`_keys` pads with zeros)."""
    num_q_heads = q_row.shape[0]
    if not keys or not any(vis.any() for _, _, vis in keys):
        return np.zeros_like(q_row)
    if mask_value is None:
        keys = [(k[vis], v[vis], vis[vis]) for k, v, vis in keys]
    k = np.concatenate([k for k, _, _ in keys])
    v = np.concatenate([v for _, v, _ in keys])
    visible = np.concatenate([vis for _, _, vis in keys])
    group = num_q_heads // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    with np.errstate(invalid="ignore"):  # NaN keys past kv_len: their score is replaced
        s = np.einsum("hd,nhd->hn", q_row, k) * sm_scale
    s = np.where(visible[None, :], s, mask_value if mask_value is not None else 0.0)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return np.einsum("hn,nhd->hd", p / p.sum(axis=1, keepdims=True), v)


def _all_masked(v, span: int, num_q_heads: int):
    """A row whose every key is masked, as the kernel computes it: each masked score is the
    same mask_value, so each of the `span` positions visited weighs 1 / span (V is 0 past
    kv_len). [num_q_heads, head_dim]"""
    mean = _padded(v, span).sum(axis=0) / span  # [num_kv_heads, head_dim]
    return np.repeat(mean, num_q_heads // v.shape[1], axis=0)


def _padded(x, span: int):
    """x [kv_len, ...] cut or padded with zeros to `span` positions (a V past kv_len is 0)."""
    out = np.zeros((span, *x.shape[1:]))
    n = min(span, x.shape[0])
    out[:n] = x[:n]
    return out


def _num_kv_blocks(kv_len, q_len, last_row_in_seq, block_kv):
    return -(-(kv_len - q_len + last_row_in_seq + 1) // block_kv)


def prefill(variant: str = "right"):
    """Rung 6's walk in numpy, with the mistake `variant` ("right": none, the checker's
    reference, float64): fn(q, kv_pages, kv_lens, page_indices, q_lens, *, sm_scale, ...).

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(2, 9)], page_size=8)
    >>> q = np.asarray(b.q)[None]   # [1 sequence, 2 rows, heads, head_dim]
    >>> prefill()(q, b.kv_pages, b.kv_lens, b.page_indices, [2], sm_scale=0.1, block_q=2,
    ...           num_kv_pages_per_block=1).shape
    (1, 2, 4, 64)
    """

    def fn(q, kv_pages, kv_lens, page_indices, q_lens, *, sm_scale, block_q,
           num_kv_pages_per_block):  # fmt: skip
        qn, table = np.asarray(q, np.float64), np.asarray(page_indices)
        block_kv = num_kv_pages_per_block * kv_pages.shape[1]
        out = np.zeros(qn.shape)
        for s, kv_len in enumerate(int(n) for n in np.asarray(kv_lens)):
            q_len = int(np.asarray(q_lens)[s])
            k, v = _keys(kv_pages, table, s, kv_len) if q_len else (None, None)
            for r in range(q_len):
                first_row = r - r % block_q
                last = min(first_row + block_q, q_len) - 1
                limit = min(kv_len, _num_kv_blocks(kv_len, q_len, last, block_kv) * block_kv)
                q_pos = {"no_kv_offset": r,
                         "no_block_offset": kv_len - q_len + r - first_row,
                         "causal_plus_one": kv_len - q_len + r + 1,
                         "causal_minus_one": kv_len - q_len + r - 1,
                         }.get(variant, kv_len - q_len + r)  # fmt: skip
                visible = (np.arange(kv_len) <= q_pos) & (np.arange(kv_len) < limit)
                out[s, r] = _attend(qn[s, r], [(k, v, visible)], sm_scale)
                if q_pos < 0:  # no key visible: the kernel's masked scores weigh all alike
                    span = _num_kv_blocks(kv_len, q_len, last, block_kv) * block_kv
                    out[s, r] = _all_masked(v, span, qn.shape[2])
        return out

    return fn


def ragged(variant: str = "right"):
    """Rung 7's walk in numpy, with the mistake `variant` ("right": none, the checker's
    reference, float64): fn with JAX's signature; the padding rows are 0.

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(3, 3), (1, 9)], page_size=8, max_num_batched_tokens=8)
    >>> out = ragged()(*b.args(), sm_scale=0.1, num_queries_per_block=4, num_kv_pages_per_block=1)
    >>> out.shape, float(abs(out[4:]).max())   # rows past the 4 live ones: 0
    ((8, 4, 64), 0.0)
    """

    def fn(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        *,
        sm_scale,
        num_queries_per_block,
        num_kv_pages_per_block,
        mask_value=None,
    ):
        qn, table, block_q = (
            np.asarray(q, np.float64),
            np.asarray(page_indices),
            num_queries_per_block,
        )
        cu, n = [int(x) for x in np.asarray(cu_q_lens)], int(np.asarray(num_seqs)[0])
        block_kv = num_kv_pages_per_block * kv_pages.shape[1]
        out = np.zeros(qn.shape)
        # The output block's buffer, which interpret mode keeps from one grid step to the
        # next: a row the kernel does not write holds what the step before left there (NaN
        # at first). Only the block-local row masks leave live rows unwritten.
        held = np.full((block_q, *qn.shape[1:]), np.nan)
        for blk in range(qn.shape[0] // block_q):
            first_row, end_row = blk * block_q, (blk + 1) * block_q
            seen = {r: [] for r in range(first_row, end_row)}  # keys each row's state holds
            if variant in BLOCK_LOCAL_ROWS:
                out[first_row:end_row] = held
            for s in range(n):
                q_start, q_end, kv_len = cu[s], cu[s + 1], int(np.asarray(kv_lens)[s])
                if q_end <= first_row or q_start >= end_row or q_end == q_start:
                    continue  # no row of s in this q block
                q_len = q_end - q_start
                k, v = _keys(kv_pages, table, s, kv_len)
                last = min(q_end, end_row) - 1 - q_start
                span = _num_kv_blocks(kv_len, q_len, last, block_kv) * block_kv
                limit = min(kv_len, span)
                positions = np.arange(kv_len)
                if mask_value is not None:  # every position of the KV blocks visited
                    k, v, positions = _padded(k, span), _padded(v, span), np.arange(span)
                for row in range(first_row, end_row):
                    local = row - first_row  # the row's place in its q block
                    q_pos = {"no_kv_offset": row - q_start,
                             "global_row": kv_len - q_len + row,
                             "q_pos_from_q_block": kv_len - q_len + local,
                             "q_pos_no_first_row": kv_len - q_len + local - q_start,
                             "row_no_first_row": kv_len - q_len + local - q_start,
                             "no_causal_mask": kv_len - 1,
                             "causal_plus_one": kv_len - q_len + row - q_start + 1,
                             "causal_minus_one": kv_len - q_len + row - q_start - 1,
                             }.get(variant, kv_len - q_len + row - q_start)  # fmt: skip
                    visible = (positions <= q_pos) & (positions < limit)
                    keys = (seen[row] if variant == "no_reset" else []) + [(k, v, visible)]
                    seen[row] = keys
                    if _writes(variant, row, local, q_start, q_end):
                        out[row] = _attend(qn[row], keys, sm_scale, mask_value)
            held = out[first_row:end_row].copy()
        out[cu[n] :] = 0  # padding rows: not compared
        return out

    return fn


# The variants whose row mask counts the q block's rows from 0, not from first_row.
BLOCK_LOCAL_ROWS = ("rows_block_local", "row_no_first_row")


def _writes(variant: str, row: int, local: int, q_start: int, q_end: int) -> bool:
    """Whether a sequence of rows q_start .. q_end - 1 writes `row` of the batch, the row
    `local` of its q block (counted from 0)."""
    if variant == "no_row_mask":
        return True
    if variant in BLOCK_LOCAL_ROWS:  # the mask compares the row's place in its q block
        return q_start <= local < q_end
    return q_start <= row < q_end


def scale_and_mask_swapped(fn):
    """`fn` given mask_value as its sm_scale and sm_scale as its mask_value (the two last
    arguments of `attend_rows` in the wrong order), where the call gives a mask_value."""

    def wrong(*args, sm_scale, mask_value=None, **options):
        if mask_value is None:  # the kernel's default then: no simulation of that here
            return None
        return fn(*args, sm_scale=mask_value, mask_value=sm_scale, **options)

    return wrong


def head_dim_scale(fn):
    """`fn` scaling the scores by 1/sqrt(head_dim), whatever sm_scale it is given."""

    def wrong(q, *args, sm_scale, **options):
        return fn(q, *args, sm_scale=q.shape[-1] ** -0.5, **options)

    return wrong


def sm_scale_ignored(fn):
    """`fn` never scaling the scores: sm_scale 1, whatever it is given."""

    def wrong(*args, sm_scale, **options):
        return fn(*args, sm_scale=1.0, **options)

    return wrong


def mask_value_ignored(fn):
    """`fn` with the default mask (masked keys weigh nothing), whatever mask_value it is
    given."""

    def wrong(*args, mask_value=None, **options):
        return fn(*args, **options)

    return wrong


def prefill_mistakes() -> dict:
    """Rung 6's mistakes: explanation -> fn(q, kv_pages, kv_lens, page_indices, q_lens, ...).

    >>> any("kv_len - q_len" in why for why in prefill_mistakes())
    True
    """
    return {
        NO_KV_OFFSET: prefill("no_kv_offset"),
        "the q block's first row is missing from q_pos: row r of q block i is row "
        "`first_row + r` of the chunk, first_row = i * block_q, at position kv_len - q_len + "
        "first_row + r.": prefill("no_block_offset"),
        SM_SCALE_IGNORED: head_dim_scale(prefill()),
        NO_SM_SCALE: sm_scale_ignored(prefill()),
        CAUSAL_PLUS_ONE: prefill("causal_plus_one"),
        CAUSAL_MINUS_ONE: prefill("causal_minus_one"),
    }


def ragged_mistakes() -> dict:
    """Rung 7's mistakes: explanation -> fn with JAX's signature.

    >>> len(ragged_mistakes())
    15
    """
    return {
        "the rows of other sequences were overwritten: a q block's rows belong to several "
        "sequences, and each sequence writes only its own rows: `write_rows(o_ref, l_ref, "
        "acc_ref, rows)`, rows = (q_start <= row) & (row < q_start + q_len).":
            ragged("no_row_mask"),
        "the softmax state was not reset between the sequences of a q block: m, l and acc "
        "start again (`init_online_softmax`) for every sequence.": ragged("no_reset"),
        "q_pos counts the row's place in the whole batch: its place in its sequence is "
        "row - q_start (row = first_row + r), at position kv_len - q_len + row - q_start.":
            ragged("global_row"),
        NO_KV_OFFSET: ragged("no_kv_offset"),
        SM_SCALE_IGNORED: head_dim_scale(ragged()),
        NO_SM_SCALE: sm_scale_ignored(ragged()),
        CAUSAL_PLUS_ONE: ragged("causal_plus_one"),
        CAUSAL_MINUS_ONE: ragged("causal_minus_one"),
        "q_pos counts the row's place in its q block, not in its sequence: row r of the q "
        "block is row `first_row + r - q_start` of its sequence, at position kv_len - q_len + "
        "first_row + r - q_start.": ragged("q_pos_from_q_block"),
        "first_row is missing from q_pos: the q block's row r is row `first_row + r` of the "
        "batch, so row = first_row + iota, and q_pos = kv_len - q_len + row - q_start.":
            ragged("q_pos_no_first_row"),
        ROWS_BLOCK_LOCAL: ragged("rows_block_local"),
        ROW_NO_FIRST_ROW: ragged("row_no_first_row"),
        "no causal mask: every row sees every key of the KV blocks visited (below kv_len), as a "
        "decode row does. A row of a chunk sits at q_pos = kv_len - q_len + row - q_start and "
        "sees only k_pos <= q_pos.":
            ragged("no_causal_mask"),
        "sm_scale and mask_value are swapped: the scores were scaled by mask_value and the "
        "masked ones set to sm_scale. `attend_rows` takes them in the order (..., kv_len, "
        "sm_scale, mask_value).": scale_and_mask_swapped(ragged()),
        "mask_value is ignored: a masked key's score is the mask_value the kernel is given "
        "(here one whose masked keys weigh something), not the default: pass it on, "
        "`attend_rows(..., sm_scale, mask_value)`.": mask_value_ignored(ragged()),
    }  # fmt: skip

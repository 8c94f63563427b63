"""Notebook 08's ragged exercises: rung 6 (a prefill chunk) and rung 7 (the ragged batch).

Both checkers run the learner's kernel in strict TPU interpret mode, watched (as
`minilib.exercises.ex08_ladder` does for rungs 2 to 5), against the kernel's walk in float64
numpy (`ragged_mistakes`; the ladder's tests hold the rungs to JAX's reference), on batches
with several KV blocks per sequence, `block_q != block_kv` both ways, a chunk whose kv_len is
a whole number of pages, q_len 0 slots, a q block that ends mid-sequence, an all-idle batch,
NaN in every unused page and q padding row, and page-table entries past a sequence's last page
that point past the end of `kv_pages`. Only live rows are compared.

Whatever the output, the copies must be the planned ones (`prefill_copy_plan`,
`ragged_copy_plan`): each KV block's pages, into its slot, in order, no block past the
diagonal, nothing for an idle sequence, and (rung 7) each q block's first block started by
the grid step before. The first difference is named with its likely cause
(`minilib.exercises.ragged_causes`). A wrong output is matched against the usual mistakes,
simulated in numpy (`ragged_mistakes`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from minilib.batch import make_batch
from minilib.exercises.checking import Case, CheckResult
from minilib.exercises.kernel_checking import check_kernel
from minilib.exercises.kernel_failures import Names
from minilib.exercises.ragged_causes import advice, schedule_problem
from minilib.exercises.ragged_mistakes import prefill, prefill_mistakes, ragged, ragged_mistakes
from minilib.kv_cache import pages_needed

__all__ = ["check_prefill_chunk", "check_ragged_paged_attention"]

GARBAGE_PAGE = 1000

# page_size, pages_per_seq, num_q_heads, num_kv_heads, head_dim, block_q, pages per KV block
PREFILL_SHAPES = [(8, 6, 4, 2, 128, 8, 2), (4, 9, 2, 1, 64, 8, 3)]
# A masked key's score in one of rung 7's cases: the kernel sets it (`attend_rows`), and here
# the masked keys weigh exp(-3) each, so a kernel that ignores mask_value shows.
MASK_VALUE = -3.0
# Two page counts per KV block (2, then 3), so a kernel that hard-codes one of them shows.
RAGGED_SHAPES = [(8, 5, 4, 2, 128, 8, 2), (4, 10, 2, 1, 64, 16, 3)]


def _batch(shape, seq_lens, *, max_num_seqs, tokens, garbage: bool, seed: int):
    page_size, pages_per_seq, num_q_heads, num_kv_heads, head_dim, *_ = shape
    batch = make_batch(
        seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size, pages_per_seq=pages_per_seq, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=tokens, seed=seed,
    )  # fmt: skip
    table = np.asarray(batch.page_indices).copy()
    if garbage:  # past a sequence's last page: page numbers past the end of kv_pages
        total = batch.kv_pages.shape[0]
        for seq, (_, kv_len) in enumerate(seq_lens):
            used = pages_needed(kv_len, page_size)
            table[seq, used:] = total + GARBAGE_PAGE + np.arange(used, pages_per_seq)
    held = "past the end of kv_pages" if garbage else "unused pages of NaN"
    what = (f"(q_len, kv_len) = {list(seq_lens)}, page_size={page_size}, "
            f"num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}; "
            f"page-table entries past each sequence's pages hold garbage ({held})")  # fmt: skip
    return batch, jnp.asarray(table), what


# --- rung 6 -------------------------------------------------------------------------------------


def _prefill_cases(seed: int) -> list[Case]:
    rng = np.random.default_rng(860 + seed)
    cases = []
    for k, shape in enumerate(PREFILL_SHAPES):
        page_size, pages_per_seq, *_, block_q, per_block = shape
        full = page_size * pages_per_seq
        max_q_len = 2 * block_q
        if k == 0:  # a chunk ending on a page boundary, a whole prefill, an idle slot, q_len 2
            lens = [(max_q_len, 5 * page_size), (12, 12), (0, 9), (2, full)]
        else:
            lens = [(int(q), int(q + rng.integers(0, full - q + 1)))
                    for q in rng.integers(2, max_q_len + 1, size=3)]  # fmt: skip
        for garbage in (True, False):
            cases.append(_prefill_case(shape, lens, max_q_len, garbage, seed * 10 + k))
    return cases


def _prefill_case(shape, seq_lens, max_q_len, garbage, seed) -> Case:
    *_, block_q, per_block = shape
    tokens = sum(q for q, _ in seq_lens)
    batch, table, what = _batch(shape, seq_lens, max_num_seqs=len(seq_lens), tokens=tokens,
                                garbage=garbage, seed=seed)  # fmt: skip
    q = np.full((len(seq_lens), max_q_len, *batch.q.shape[1:]), np.nan, np.float32)
    cu = np.asarray(batch.cu_q_lens)
    for s, (q_len, _) in enumerate(seq_lens):
        q[s, :q_len] = np.asarray(batch.q[cu[s] : cu[s] + q_len], np.float32)
    sm_scale = 0.05 if shape[4] == 128 else 0.2
    args = (jnp.asarray(q), batch.kv_pages, batch.kv_lens, table,
            jnp.asarray([ql for ql, _ in seq_lens], jnp.int32))  # fmt: skip
    kwargs = dict(sm_scale=sm_scale, block_q=block_q, num_kv_pages_per_block=per_block)
    return Case(f"{what}; block_q={block_q}, num_kv_pages_per_block={per_block}, "
                f"sm_scale={sm_scale}", args, kwargs)  # fmt: skip


def _prefill_live_rows(fn: Callable) -> Callable:
    """fn with the rows past each q_len zeroed: only live rows are compared."""

    def live_rows_only(q, kv_pages, kv_lens, page_indices, q_lens, **kwargs):
        out = fn(q, kv_pages, kv_lens, page_indices, q_lens, **kwargs)
        rows = jnp.arange(q.shape[1])[None, :] < q_lens[:, None]
        return jnp.where(rows[:, :, None, None], out, 0)

    return live_rows_only


def _prefill_compile_case() -> Case:
    s, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    return Case(
        "bf16, 4 chunks of 32 rows, page_size=16, num_q_heads=8, num_kv_heads=2, head_dim=128",
        (s((4, 32, 8, 128), bf16), s((64, 16, 4, 128), bf16), s((4,), jnp.int32),
         s((4, 8), jnp.int32), s((4,), jnp.int32)),
        dict(sm_scale=128**-0.5, block_q=16, num_kv_pages_per_block=2),
    )  # fmt: skip


def check_prefill_chunk(
    fn: Callable, *, seed: int = 0, verbose: bool = True, details: bool = False
) -> CheckResult:
    """Rung 6: `fn(q, kv_pages, kv_lens, page_indices, q_lens, *, sm_scale, block_q,
    num_kv_pages_per_block, interpret)`, q [num_seqs, max_q_len, num_q_heads, head_dim],
    one grid step per q block of one sequence's chunk, KV blocks double-buffered.

    >>> from minilib.ladder.prefill_chunk import prefill_chunk_attention as fn
    >>> check_prefill_chunk(fn).status
    Passed: prefill_chunk matches the reference on all 4 cases...
    'passed'
    """
    return check_kernel(
        "prefill_chunk", _prefill_live_rows(fn), prefill(), _prefill_cases(seed),
        compile_case=_prefill_compile_case(), mistakes=prefill_mistakes(), verbose=verbose,
        details=details, names=_names, advice=advice(6), record_grid=True,
        ledger_check=schedule_problem(6), error_ledger_check=schedule_problem(6, partial=True),
    )  # fmt: skip


# --- rung 7 -------------------------------------------------------------------------------------


def _ragged_cases(seed: int) -> list[Case]:
    rng = np.random.default_rng(870 + seed)
    first, second = RAGGED_SHAPES
    ps = first[0]
    # decode, idle (q_len 0 with keys), a chunk over q blocks 0-1 ending on a page boundary,
    # an empty slot, a long chunk: the first q block ends mid-sequence
    edges = [(5, 13), (0, 9), (1, 2 * ps), (10, 3 * ps), (0, 0), (3, 5 * ps)]
    lens = [(int(q), int(q + rng.integers(0, 5 * ps - q + 1))) for q in rng.integers(0, 9, 4)]
    # mask_value: in one case, a value whose masked keys weigh something (exp(-3) against
    # scores near 0), so that a kernel which ignores it shows; else the default (None).
    return [
        _ragged_case(first, edges, 6, 24, True, seed, mask_value=MASK_VALUE),
        _ragged_case(first, [(0, 7), (0, 0), (0, 12)], 4, 16, False, seed + 1),  # all idle
        _ragged_case(first, lens, 6, 32, False, seed + 2),
        # sequence 0's last position, 12, a whole number of KV blocks of 3 pages of 4 tokens
        _ragged_case(second, [(3, 13), (20, 30), (0, 4), (6, 40)], 5, 32, True, seed + 3),
        _ragged_case(second, [(1, 40), (1, 1), (17, 17)], 3, 32, False, seed + 4),
    ]


def _ragged_case(shape, seq_lens, max_num_seqs, tokens, garbage, seed, mask_value=None) -> Case:
    *_, block_q, per_block = shape
    batch, table, what = _batch(shape, seq_lens, max_num_seqs=max_num_seqs, tokens=tokens,
                                garbage=garbage, seed=seed)  # fmt: skip
    sm_scale = 0.05 if shape[4] == 128 else 0.2
    args = (batch.q, batch.kv_pages, batch.kv_lens, table, batch.cu_q_lens, batch.num_seqs)
    kwargs = dict(sm_scale=sm_scale, num_queries_per_block=block_q,
                  num_kv_pages_per_block=per_block)  # fmt: skip
    masked = ""
    if mask_value is not None:
        kwargs["mask_value"] = mask_value
        masked = f", mask_value={mask_value}"
    return Case(
        f"{what}; {tokens} q rows, {max_num_seqs} sequence slots; "
        f"num_queries_per_block={block_q}, num_kv_pages_per_block={per_block}, "
        f"sm_scale={sm_scale}{masked}",
        args,
        kwargs,
    )


def _ragged_live_rows(fn: Callable) -> Callable:
    """fn with the padding rows past cu_q_lens[num_seqs] zeroed: only live rows compared."""

    def live_rows_only(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kwargs):
        out = fn(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kwargs)
        rows = jnp.arange(q.shape[0]) < cu_q_lens[num_seqs[0]]
        return jnp.where(rows[:, None, None], out, 0)

    return live_rows_only


def _ragged_compile_case() -> Case:
    s, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    return Case(
        "bf16, 64 q rows, 8 sequence slots, page_size=16, num_q_heads=8, num_kv_heads=2, "
        "head_dim=128",
        (s((64, 8, 128), bf16), s((64, 16, 4, 128), bf16), s((8,), jnp.int32),
         s((8, 8), jnp.int32), s((9,), jnp.int32), s((1,), jnp.int32)),
        dict(sm_scale=128**-0.5, num_queries_per_block=16, num_kv_pages_per_block=2),
    )  # fmt: skip


def check_ragged_paged_attention(
    fn: Callable, *, seed: int = 0, verbose: bool = True, details: bool = False
) -> CheckResult:
    """Rung 7: `fn(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
    num_queries_per_block, num_kv_pages_per_block, interpret)`, JAX's signature: q blocks
    that span sequences, the next copy chosen across sequence and q-block boundaries.

    >>> from minilib.ladder.ragged import ragged_paged_attention_ladder as fn
    >>> check_ragged_paged_attention(fn).status
    Passed: ragged_paged_attention matches the reference on all 5 cases...
    'passed'
    """
    return check_kernel(
        "ragged_paged_attention", _ragged_live_rows(fn), ragged(),
        _ragged_cases(seed), compile_case=_ragged_compile_case(), mistakes=ragged_mistakes(),
        verbose=verbose, details=details, names=_names, advice=advice(7), record_grid=True,
        ledger_check=schedule_problem(7), error_ledger_check=schedule_problem(7, partial=True),
    )  # fmt: skip


def _names(case: Case) -> Names:
    return Names(buffer="bufs", semaphores=("sems[0]", "sems[1]"))

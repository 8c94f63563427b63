"""Notebook 09's exercises: a batch's arithmetic intensity, and the largest KV block that fits
a VMEM budget."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minilib.exercises.checking import Case, CheckResult, diagnose, run_check
from minilib.exercises.comparisons import Mismatch, as_int, compare_values
from minilib.kernel import LANES
from minilib.kv_cache import pages_needed
from minilib.perf.roofline import rpa_cost
from minilib.tpu.memory import DEFAULT_SCOPED_VMEM_BYTES

__all__ = ["check_arithmetic_intensity", "check_num_kv_pages_per_block", "kernel_vmem_bytes"]

# --- 9.1: arithmetic intensity --------------------------------------------------------------


def _intensity(seq_lens, *, num_q_heads, num_kv_heads, head_dim, page_size, itemsize):
    cost = rpa_cost(seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, page_size=page_size, q_itemsize=itemsize)  # fmt: skip
    return cost.intensity


def _intensity_with(*, pairs=None, kv_heads=None, kv_slots=None, flops_per_pair=4, q_and_out=True):
    """The intensity with one term computed wrongly, for the checker's likely causes."""

    def intensity(seq_lens, *, num_q_heads, num_kv_heads, head_dim, page_size, itemsize):
        live = [(q, kv) for q, kv in seq_lens if q > 0]
        seen = sum((pairs or _visible)(q, kv) for q, kv in live)
        slots = sum((kv_slots or _page_slots)(kv, page_size) for _, kv in live)
        heads = num_q_heads if kv_heads == "q" else num_kv_heads
        rows = sum(q for q, _ in live)
        flops = flops_per_pair * head_dim * num_q_heads * seen
        kv_bytes = slots * 2 * heads * head_dim * itemsize
        row_bytes = 2 * rows * num_q_heads * head_dim * itemsize if q_and_out else 0
        return flops / (kv_bytes + row_bytes)

    return intensity


def _visible(q_len, kv_len):
    return sum(kv_len - q_len + i + 1 for i in range(q_len))


def _page_slots(kv_len, page_size):
    return pages_needed(kv_len, page_size) * page_size


def check_arithmetic_intensity(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(seq_lens, *, num_q_heads, num_kv_heads, head_dim, page_size, itemsize) ->
    float`: the useful FLOPs of a batch of `(q_len, kv_len)` pairs over the bytes it must move
    through HBM, with `minilib.perf.roofline.rpa_cost`'s conventions:

      FLOPs: 4 * head_dim per visible (q row, key) pair and q head (two matmuls, q . k and
             probs . v, a multiply and an add each); row i of a sequence sees kv_len - q_len
             + i + 1 keys (causal);
      bytes: q and the output, num_q_heads * head_dim values a row each, and the KV cache in
             whole pages, 2 * num_kv_heads * head_dim values a token slot (K and V);
             `itemsize` bytes a value. An idle sequence (q_len 0) reads nothing.

    >>> check_arithmetic_intensity(_intensity)
    Passed: arithmetic_intensity matches the reference on all 8 cases.
    CheckResult('arithmetic_intensity', status='passed')
    """
    rng = np.random.default_rng(1000 + seed)
    specs = [  # (seq_lens, num_q_heads, num_kv_heads, head_dim, page_size, itemsize)
        ([(1, 4096)], 32, 8, 128, 16, 2),  # a Llama-3-8B-like decode
        ([(4096, 4096)], 32, 8, 128, 16, 2),  # its prefill
        ([(1, 17), (1, 33), (1, 100)], 8, 2, 64, 16, 2),  # partial last pages
        ([(8, 8), (1, 40), (0, 25), (5, 24)], 8, 2, 64, 16, 4),  # mixed, one idle
        ([(3, 10)], 4, 4, 32, 4, 1),  # MHA, a chunk, fp8
        ([(1, 1)], 16, 1, 128, 128, 2),  # MQA, one key in a big page
    ]
    for _ in range(2):
        kv = [int(x) for x in rng.integers(1, 600, size=int(rng.integers(1, 5)))]
        pairs = [(int(rng.integers(0, min(k, 64) + 1)), k) for k in kv]
        specs.append((pairs, 16, int(rng.choice([1, 2, 8])), 128, int(rng.choice([8, 16, 32])), 2))
    cases = []
    for seq_lens, nq, nkv, d, ps, size in specs:
        kwargs = dict(num_q_heads=nq, num_kv_heads=nkv, head_dim=d, page_size=ps, itemsize=size)
        description = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        cases.append(Case(f"seq_lens={seq_lens}, {description}", (seq_lens,), kwargs))

    def every_pair(q_len, kv_len):
        return q_len * kv_len

    mistakes = {
        "every (row, key) pair counted: row i of a sequence sees only keys up to its position "
        "kv_len - q_len + i, so it has kv_len - q_len + i + 1 visible pairs.": _intensity_with(
            pairs=every_pair
        ),
        "the KV cache holds num_kv_heads heads, not num_q_heads: with GQA a KV head's bytes "
        "are read once for its whole group of q heads.": _intensity_with(kv_heads="q"),
        "the cache is read in whole pages: ceil(kv_len / page_size) * page_size token slots.": (
            _intensity_with(kv_slots=lambda kv_len, page_size: kv_len)
        ),
        "each pair costs 2 matmuls (q . k, then probs . v) of head_dim multiply-adds, and a "
        "multiply-add is 2 FLOPs: 4 * head_dim per pair and q head.": _intensity_with(
            flops_per_pair=2
        ),
        "q must be read and the output written too: 2 * num_q_heads * head_dim * itemsize "
        "bytes per row.": _intensity_with(q_and_out=False),
    }

    def compare(want, got, case):
        if got is None:
            raise Mismatch("FLOP/byte: got None. Did you forget to `return` it?")
        try:  # [x] is not x: float() of an array with ndim > 0 is deprecated by NumPy
            value = float(got) if np.ndim(got) == 0 else None
        except (TypeError, ValueError):
            value = None
        if value is None:
            raise Mismatch(
                f"FLOP/byte: expected one number, got {type(got).__name__} {str(got)[:60]}"
            )
        if not np.isclose(value, want, rtol=1e-6, atol=1e-6):
            raise Mismatch(f"FLOP/byte: expected {want:.6g}, got {value:.6g}")

    return run_check(
        "arithmetic_intensity", fn, _intensity, cases, diagnose(compare, mistakes), verbose=verbose
    )


# --- 9.2: the largest KV block that fits a VMEM budget ----------------------------------------


def kernel_vmem_bytes(
    num_kv_pages_per_block: int,
    *,
    page_size: int,
    num_kv_heads_per_block: int,
    group: int,
    head_dim: int,
    itemsize: int,
    num_queries_per_block: int,
    padded_slot: bool = False,
    kv_slots: int = 2,
    q_out_buffers: int = 2,
    folded_q: bool = True,
    state_lanes: int = LANES,
    spills: bool = True,
    score_lanes: int = LANES,
) -> int:
    """The mixed kernel's VMEM for one heads block, as notebook 09 adds it up, in bytes:

      KV slots:  2 slots * num_kv_pages_per_block * page_size tokens, each token 2 * kvh
                 combined heads of head_dim values (2 * kvh + 2 with `padded_slot`: the
                 spare row per token of a bf16 slot on v5e, v6e and TPU7x);
      q, out:    the q and output blocks, each double-buffered by Pallas: 2 * 2 blocks of
                 num_queries_per_block * kvh * group rows of head_dim values;
      folded q:  the q block once more, each KV head's q heads folded into rows (`q_fold_ref`);
      m, l, acc: the softmax state in float32, m and l 128 lanes a row, acc head_dim;
      spills:    one float32 score matrix per KV head, [rows, kv tokens rounded up to whole
                 128-lane registers]: not a buffer of the kernel, but about what Mosaic
                 spills to VMEM from the vector registers at the course's shapes.
    (kvh = num_kv_heads_per_block; rows = num_queries_per_block * group; the first three in
    `itemsize` bytes.) What it leaves out: Mosaic's internal scratch (36 KiB on v5e), and how
    far the spills stray from one score matrix per KV head. Notebook 09 holds the sum against
    the compiled kernel's VMEM.

    The keywords after `padded_slot` exist to model mistakes; the kernel's values are the
    defaults.

    >>> kernel_vmem_bytes(1, page_size=16, num_kv_heads_per_block=1, group=1, head_dim=128,
    ...                   itemsize=2, num_queries_per_block=8)
    43008
    """
    kvh, rows = num_kv_heads_per_block, num_queries_per_block * group
    tokens = num_kv_pages_per_block * page_size
    heads_per_token = 2 * kvh + (2 if padded_slot else 0)
    kv = kv_slots * tokens * heads_per_token * head_dim * itemsize
    q_and_out = 2 * q_out_buffers * kvh * rows * head_dim * itemsize
    fold = kvh * rows * head_dim * itemsize if folded_q else 0
    state = kvh * rows * (2 * state_lanes + head_dim) * 4
    score_tokens = -(-tokens // score_lanes) * score_lanes
    scores = kvh * rows * score_tokens * 4 if spills else 0
    return kv + q_and_out + fold + state + scores


def _largest_block(vmem_budget_bytes, *, pages_per_seq, cap=True, strict=False,
                   **shapes) -> int:  # fmt: skip
    """The largest n <= pages_per_seq whose VMEM fits the budget; 0 if n = 1 does not."""

    def fits(n):
        need = kernel_vmem_bytes(n, **shapes)
        return need < vmem_budget_bytes if strict else need <= vmem_budget_bytes

    n = 0
    while (n < pages_per_seq or not cap) and fits(n + 1):
        n += 1
    return n


def _num_kv_pages_per_block(vmem_budget_bytes, *, page_size, pages_per_seq,
                            num_kv_heads_per_block, group, head_dim, itemsize,
                            num_queries_per_block, padded_slot):  # fmt: skip
    return _largest_block(
        vmem_budget_bytes, pages_per_seq=pages_per_seq, page_size=page_size,
        num_kv_heads_per_block=num_kv_heads_per_block, group=group, head_dim=head_dim,
        itemsize=itemsize, num_queries_per_block=num_queries_per_block, padded_slot=padded_slot,
    )  # fmt: skip


def check_num_kv_pages_per_block(
    fn: Callable, *, seed: int = 0, verbose: bool = True
) -> CheckResult:
    """Check `fn(vmem_budget_bytes, *, page_size, pages_per_seq, num_kv_heads_per_block, group,
    head_dim, itemsize, num_queries_per_block, padded_slot) -> int`: the largest
    num_kv_pages_per_block, at most pages_per_seq, whose VMEM fits in `vmem_budget_bytes`; 0
    if not even one page fits. The VMEM is notebook 09's sum (see `kernel_vmem_bytes`), with
    kvh = num_kv_heads_per_block, rows = num_queries_per_block * group, and
    tokens = num_kv_pages_per_block * page_size:

      KV slots:  2 * tokens * (2*kvh, or 2*kvh + 2 if padded_slot) * head_dim
      q, out:    2 blocks * 2 buffers * kvh * rows * head_dim
      folded q:  kvh * rows * head_dim                  (these three in `itemsize` bytes)
      m, l, acc: kvh * rows * (2*128 + head_dim)        float32 values
      spills:    kvh * rows * (tokens rounded up to a multiple of 128)   float32 values

    >>> check_num_kv_pages_per_block(_num_kv_pages_per_block)
    Passed: num_kv_pages_per_block matches the reference on all 12 cases.
    CheckResult('num_kv_pages_per_block', status='passed')
    """
    rng = np.random.default_rng(1100 + seed)
    llama = dict(page_size=16, pages_per_seq=256, num_kv_heads_per_block=8, group=4,
                 head_dim=128, itemsize=2, num_queries_per_block=32, padded_slot=False)  # fmt: skip
    padded = llama | dict(padded_slot=True)
    small = dict(page_size=16, pages_per_seq=64, num_kv_heads_per_block=1, group=8,
                 head_dim=128, itemsize=2, num_queries_per_block=16, padded_slot=False)  # fmt: skip
    short = dict(page_size=32, pages_per_seq=6, num_kv_heads_per_block=2, group=2,
                 head_dim=64, itemsize=4, num_queries_per_block=8, padded_slot=False)  # fmt: skip
    mib = 2**20

    def fits(shapes, n):  # the budget that exactly fits n pages
        return kernel_vmem_bytes(n, **{k: v for k, v in shapes.items() if k != "pages_per_seq"})

    budgets = [
        (int(0.9 * DEFAULT_SCOPED_VMEM_BYTES["v5e"]), llama, "90% of v5e's default scoped VMEM"),
        (int(0.9 * DEFAULT_SCOPED_VMEM_BYTES["v6e"]), padded, "90% of v6e's, its padded slot"),
        (fits(llama, 12), llama, "exactly 12 pages' worth"),
        (fits(llama, 12) - 1, llama, "one byte short of 12 pages"),
        (fits(llama, 5), llama, "exactly 5 pages' worth: 80 tokens, scores of 128 lanes"),
        (4 * mib, small, "4 MiB"),
        (128 * mib, short, "more than pages_per_seq pages' worth"),
        (fits(short, 1) - 1, short, "one byte short of one page"),
        (fits(short, 0) // 2, short, "not even room for q, the output and the state"),
        (fits(padded, 3), padded, "exactly 3 pages' worth of the padded slot"),
    ]
    for shapes in (small, short):
        budgets.append((fits(shapes, int(rng.integers(1, 40))) + int(rng.integers(0, 5000)),
                        shapes, "a random budget"))  # fmt: skip
    cases = []
    for budget, shapes, what in budgets:
        described = ", ".join(f"{k}={v}" for k, v in shapes.items())
        cases.append(Case(f"vmem_budget_bytes={budget} ({what}), {described}", (budget,), shapes))

    def making(**mistake):
        search = {k: mistake.pop(k) for k in ("cap", "strict") if k in mistake}

        def choose(vmem_budget_bytes, *, pages_per_seq, **shapes):
            return _largest_block(vmem_budget_bytes, pages_per_seq=pages_per_seq, **search,
                                  **(shapes | mistake))  # fmt: skip

        return choose

    def halving(vmem_budget_bytes, *, pages_per_seq, **shapes):
        n = pages_per_seq
        while n > 0 and kernel_vmem_bytes(n, **shapes) > vmem_budget_bytes:
            n //= 2
        return n

    def solving(vmem_budget_bytes, *, pages_per_seq, **shapes):
        fixed = kernel_vmem_bytes(0, **shapes)
        per_page = kernel_vmem_bytes(1, **shapes) - fixed
        return max(0, min((vmem_budget_bytes - fixed) // per_page, pages_per_seq))

    mistakes = {
        "the KV block has two slots (double buffering: one is computed on while the next block "
        "is copied into the other), so each page costs twice its bytes.": making(kv_slots=1),
        "Pallas double-buffers the q and output blocks too: 2 blocks * 2 buffers.": making(
            q_out_buffers=1
        ),
        "the kernel folds the q block into rows of its own scratch (q_fold_ref), one more q "
        "block: kvh * rows * head_dim values.": making(folded_q=False),
        "m and l are stored 128 lanes wide, one vector-register row per q row: "
        "(2 * 128 + head_dim) float32 values per row, not (2 + head_dim).": making(state_lanes=1),
        "the spills: count one float32 score matrix per KV head, kvh * rows * tokens values, "
        "with tokens rounded up to a multiple of 128.": making(spills=False),
        "a score row takes whole 128-lane vector registers: round the KV block's tokens up to a "
        "multiple of 128 in the spills.": making(score_lanes=1),
        "with padded_slot, each token of a slot has a spare row: 2 * kvh + 2 combined heads, "
        "not 2 * kvh.": making(padded_slot=False),
        "the block may not be longer than a sequence's row of pages: cap it at pages_per_seq.": (
            making(cap=False)
        ),
        "a budget that the buffers fill exactly still fits: use <=, not <.": making(strict=True),
        "halving from pages_per_seq finds *a* size that fits, not the largest: the answer need "
        "not be pages_per_seq / 2**k. Count up from 1.": halving,
        "a page does not always cost the same: the spills grow by whole 128-token registers, "
        "so dividing the room by the first page's cost can stop short. Count up from 1.": solving,
    }
    compare = diagnose(
        lambda want, got, case: compare_values(want, as_int(got), "num_kv_pages_per_block"),
        mistakes,
    )
    return run_check(
        "num_kv_pages_per_block", fn, _num_kv_pages_per_block, cases, compare, verbose=verbose
    )

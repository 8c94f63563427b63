"""Serving-step workloads: which (q_len, kv_len) pairs one step of a server batches together.

`minilib.batch` packs given pairs into arrays. This module chooses the pairs the way a
server's step would hold them: a workload sets the share of decodes (q_len 1), the rest are
prefills or prefill chunks, and every q row must fit the step's token budget,
`max_num_batched_tokens`. A `BenchCase` adds the array shapes, so that a benchmark can build
two batches of the same shapes and different lengths (`case_batches`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from minilib.batch import RaggedBatch, make_batch, random_seq_lens

__all__ = [
    "HEAD_CONFIGS",
    "TARGET_CASE",
    "WORKLOADS",
    "BenchCase",
    "case_batch",
    "case_batches",
    "fit_token_budget",
    "workload_seq_lens",
]

# Workload name -> the fraction of its sequences that decode (q_len 1); the rest are prefills
# or prefill chunks, shrunk to fit the step's token budget (max_num_batched_tokens).
WORKLOADS: dict[str, float] = {"decode-heavy": 0.9, "mixed": 0.5, "prefill-heavy": 0.1}

# Head config name -> (num_q_heads, num_kv_heads, head_dim).
HEAD_CONFIGS: dict[str, tuple[int, int, int]] = {"gqa": (32, 8, 128), "mqa": (32, 1, 128)}


def fit_token_budget(pairs, max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """Shrink the q_lens longer than 1, in proportion, until all q rows fit the budget.

    A server's scheduler does the same: a prompt too long for this step is chunked.

    >>> fit_token_budget([(1, 9), (8, 8), (8, 16)], 9)
    [(1, 9), (4, 8), (4, 16)]
    """
    pairs = [(int(q), int(kv)) for q, kv in pairs]
    live = sum(1 for q, _ in pairs if q > 0)
    if live > max_num_batched_tokens:
        raise ValueError(
            f"{live} sequences with new tokens cannot fit {max_num_batched_tokens=}: "
            "raise max_num_batched_tokens or lower num_seqs."
        )
    total = sum(q for q, _ in pairs)
    if total <= max_num_batched_tokens:
        return pairs
    small = sum(q for q, _ in pairs if q <= 1)
    scale = (max_num_batched_tokens - small) / sum(q for q, _ in pairs if q > 1)
    pairs = [(max(1, int(q * scale)) if q > 1 else q, kv) for q, kv in pairs]
    while (excess := sum(q for q, _ in pairs) - max_num_batched_tokens) > 0:
        i = max(range(len(pairs)), key=lambda j: pairs[j][0])  # the longest q gives way
        q, kv = pairs[i]
        pairs[i] = (max(1, q - excess), kv)
    return pairs


def workload_seq_lens(
    workload: str, num_seqs: int, *, max_kv_len: int, max_num_batched_tokens: int, seed: int = 0
) -> list[tuple[int, int]]:
    """Random (q_len, kv_len) pairs for one step of a workload, within the token budget.

    >>> pairs = workload_seq_lens("decode-heavy", 8, max_kv_len=64, max_num_batched_tokens=32)
    >>> len(pairs), sum(q for q, _ in pairs) <= 32
    (8, True)
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown {workload=}: choose one of {sorted(WORKLOADS)}.")
    pairs = random_seq_lens(
        num_seqs, max_kv_len=max_kv_len, decode_fraction=WORKLOADS[workload], seed=seed
    )
    return fit_token_budget(pairs, max_num_batched_tokens)


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One batch shape to time: a workload, a number of sequences, a head config.

    >>> case = BenchCase("mixed", 8, HEAD_CONFIGS["gqa"], pages_per_seq=16)
    >>> case.label(), case.max_kv_len
    ('mixed 8 seqs 32/8/128', 256)
    """

    workload: str
    num_seqs: int
    heads: tuple[int, int, int]  # num_q_heads, num_kv_heads, head_dim
    page_size: int = 16
    pages_per_seq: int = 64  # max kv_len = pages_per_seq * page_size
    max_num_batched_tokens: int = 1024
    dtype: str = "float32"

    @property
    def max_kv_len(self) -> int:
        return self.pages_per_seq * self.page_size

    @property
    def heads_label(self) -> str:
        return "/".join(str(h) for h in self.heads)

    def label(self) -> str:
        return f"{self.workload} {self.num_seqs} seqs {self.heads_label}"

    def kv_cache_bytes(self) -> int:
        """The bytes of `kv_pages`, one page per slot of the page table."""
        _, num_kv_heads, head_dim = self.heads
        values = self.num_seqs * self.max_kv_len * 2 * num_kv_heads * head_dim
        return values * jnp.dtype(self.dtype).itemsize

    def specs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Shapes and dtypes of the six arguments, to compile for without allocating them.

        >>> [s.shape for s in BenchCase("mixed", 2, (4, 2, 64), 8, 3, 16).specs()][:2]
        [(16, 4, 64), (6, 8, 4, 64)]
        """
        num_q_heads, num_kv_heads, head_dim = self.heads
        dtype, i32, spec = jnp.dtype(self.dtype), jnp.int32, jax.ShapeDtypeStruct
        total_num_pages = self.num_seqs * self.pages_per_seq
        return (
            spec((self.max_num_batched_tokens, num_q_heads, head_dim), dtype),  # q
            spec((total_num_pages, self.page_size, 2 * num_kv_heads, head_dim), dtype),
            spec((self.num_seqs,), i32),  # kv_lens
            spec((self.num_seqs, self.pages_per_seq), i32),  # page_indices
            spec((self.num_seqs + 1,), i32),  # cu_q_lens
            spec((1,), i32),  # num_seqs
        )


def case_batch(case: BenchCase, pairs, seed: int = 0) -> RaggedBatch:
    """`(q_len, kv_len)` pairs packed into a batch of `case`'s array shapes.

    >>> case = BenchCase("mixed", 3, (4, 2, 64), 8, 4, 16)
    >>> case_batch(case, [(1, 5), (1, 9)]).q.shape, case.specs()[0].shape
    ((16, 4, 64), (16, 4, 64))
    """
    num_q_heads, num_kv_heads, head_dim = case.heads
    return make_batch(
        pairs,
        seed=seed,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=case.page_size,
        max_num_batched_tokens=case.max_num_batched_tokens,
        max_num_seqs=case.num_seqs,
        pages_per_seq=case.pages_per_seq,
        total_num_pages=case.num_seqs * case.pages_per_seq + 3,
        dtype=jnp.dtype(case.dtype),
    )


def case_batches(case: BenchCase, seed: int = 0) -> tuple[RaggedBatch, RaggedBatch]:
    """Two batches of the case with the SAME array shapes and different lengths.

    >>> a, b = case_batches(BenchCase("mixed", 3, (4, 2, 64), 8, 4, 16))
    >>> a.q.shape == b.q.shape, a.seq_lens != b.seq_lens
    (True, True)
    """
    batches = []
    for s in (seed, seed + 1):
        pairs = workload_seq_lens(
            case.workload,
            case.num_seqs,
            max_kv_len=case.max_kv_len,
            max_num_batched_tokens=case.max_num_batched_tokens,
            seed=s,
        )
        batches.append(case_batch(case, pairs, seed=s))
    return batches[0], batches[1]


# The course's speed-target case: a 32-sequence mixed step of a GQA model, kv lengths drawn
# uniformly from 1 to 1024 (pages_per_seq 64 of 16 tokens), at most 1024 q rows.
TARGET_CASE = BenchCase("mixed", 32, HEAD_CONFIGS["gqa"], 16, 64, 1024)

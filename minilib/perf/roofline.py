"""The roofline of ragged paged attention: how fast could this batch possibly run on a chip?

Any implementation, however clever, must at least

  * move its bytes through HBM:   q read, the KV pages read, the output written;
  * do its useful FLOPs:          the two matmuls, q . k and probs . v, over visible keys.

So the time of a call is at least `max(bytes / HBM bandwidth, FLOPs / peak FLOP/s)`. Which of
the two wins depends on the batch's *arithmetic intensity*, FLOPs per byte, compared with the
chip's *ridge point*, peak FLOP/s / bandwidth (about 240 FLOP/byte on a v5e). Below the ridge
the chip waits for memory; above it, for the matrix unit.

Attention over a KV cache is usually far below the ridge. A decode step reads every KV byte of
its sequence to compute ONE q row per q head: each KV token is used by `group` q heads (4 for
GQA 32/8) and 1 row, about 2 * group / itemsize FLOP/byte, 4 in bf16. A prefill of L tokens
uses each KV token for ~L/2 rows, so long prefills cross the ridge and become compute-bound.

What is counted, and why:

  bytes  q rows read once, output rows written once (in q's dtype); KV read in *whole pages*
         (a page is the unit the cache is stored and copied in), only the pages holding keys
         some row can see. Idle sequences (q_len 0) need nothing. The small index arrays
         (kv_lens, page_indices, cu_q_lens) are left out: 4 bytes a sequence or page.
  FLOPs  4 * head_dim * num_q_heads per visible (q row, key) pair: 2 for the multiply-add of
         q . k, 2 for probs . v. Masked pairs are not counted: they are not *useful* work, even
         if an implementation computes them (the gather-all jnp version computes many). The
         softmax's exp and sums are left out too: they scale without head_dim and run on the
         vector units, not the matrix unit that the peak figure describes.

>>> cost = rpa_cost([(1, 1024)], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
>>> cost.kv_bytes, cost.flops                       # one decode over 1024 keys, bf16
(4194304, 16777216)
>>> point = roofline(cost, CHIPS["v5e"])
>>> point.bound, round(point.time_s * 1e6, 2)       # microseconds
('memory', 5.14)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from minilib.chips import DEVICE_KINDS, FACTS

__all__ = [
    "CHIPS",
    "Chip",
    "RPACost",
    "RooflinePoint",
    "batch_cost",
    "detect_chip",
    "explain",
    "kv_pages_read",
    "roofline",
    "rpa_cost",
    "visible_keys",
]


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator's two roofline figures, per device (one chip, or one core in split mode).

    >>> chip = Chip("my chip", hbm_bytes_per_s=1e12, peak_flops_per_s=200e12)
    >>> chip.ridge_point   # FLOP/byte
    200.0
    """

    name: str
    hbm_bytes_per_s: float  # HBM bandwidth
    peak_flops_per_s: float  # dense bf16 matmul peak

    @property
    def ridge_point(self) -> float:
        """FLOP/byte at which memory time equals compute time: below it, memory-bound."""
        return self.peak_flops_per_s / self.hbm_bytes_per_s


# Per chip, the published figures of `minilib.chips`. (JAX's own table,
# `pltpu.get_tpu_info()`, rounds a little differently, e.g. v5p 2.46 TB/s; `detect_chip` prefers
# it on a TPU when JAX has it.)
CHIPS: dict[str, Chip] = {
    key: Chip(facts.name, facts.hbm_bytes_per_s, facts.peak_flops_per_s)
    for key, facts in FACTS.items()
}


@dataclasses.dataclass(frozen=True)
class RPACost:
    """The bytes and useful FLOPs one ragged paged attention call cannot avoid.

    >>> cost = rpa_cost([(1, 32)], num_q_heads=4, num_kv_heads=2, head_dim=128, page_size=16)
    >>> cost.bytes, cost.flops, round(cost.intensity, 2), cost.rows_per_kv_token  # decode, bf16
    (34816, 65536, 1.88, 1.0)
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int  # live q rows
    kv_tokens_read: int  # KV token slots read, whole pages
    visible_pairs: int  # (q row, key) pairs the causal mask leaves visible, per q head
    q_bytes: int
    kv_bytes: int
    out_bytes: int
    flops: int

    @property
    def bytes(self) -> int:
        """All HBM traffic: q read + KV pages read + output written."""
        return self.q_bytes + self.kv_bytes + self.out_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, useful FLOPs per byte moved."""
        return self.flops / self.bytes if self.bytes else 0.0

    @property
    def rows_per_kv_token(self) -> float:
        """How many q rows, on average, use each KV token read (1 for pure decode)."""
        return self.visible_pairs / self.kv_tokens_read if self.kv_tokens_read else 0.0


def visible_keys(q_len: int, kv_len: int, sliding_window: int | None = None) -> int:
    """The (q row, key) pairs of one sequence that the causal mask leaves visible.

    The q rows are the last q_len tokens: row i sits at position kv_len - q_len + i and sees
    keys 0..that position, i.e. position + 1 keys (at most `sliding_window` of them).

    >>> visible_keys(1, 10), visible_keys(3, 3), visible_keys(2, 5, sliding_window=2)
    (10, 6, 4)
    """
    seen = np.arange(kv_len - q_len, kv_len, dtype=np.int64) + 1  # keys seen by each row
    if sliding_window is not None:
        seen = np.minimum(seen, sliding_window)
    return int(seen.sum())


def kv_pages_read(
    q_len: int, kv_len: int, page_size: int, sliding_window: int | None = None
) -> int:
    """Whole pages of one sequence that hold a key some q row can see (0 for an idle one).

    >>> kv_pages_read(1, 33, 16), kv_pages_read(0, 33, 16), kv_pages_read(1, 33, 16, 2)
    (3, 0, 2)
    """
    if q_len == 0:
        return 0
    first_key = 0
    if sliding_window is not None:
        first_key = max(0, kv_len - q_len - sliding_window + 1)  # the first row's window
    return (kv_len - 1) // page_size - first_key // page_size + 1


def rpa_cost(
    seq_lens,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    q_itemsize: int = 2,
    kv_itemsize: int | None = None,
    sliding_window: int | None = None,
) -> RPACost:
    """Bytes and useful FLOPs of a batch given as (q_len, kv_len) pairs.

    `q_itemsize` is the bytes per element of q and of the output (2 for bf16, 4 for float32);
    `kv_itemsize` that of the KV cache (default: `q_itemsize`; 1 for fp8).

    >>> rpa_cost([(3, 3)], num_q_heads=1, num_kv_heads=1, head_dim=2, page_size=4).flops
    48
    """
    kv_itemsize = q_itemsize if kv_itemsize is None else kv_itemsize
    num_tokens = sum(q_len for q_len, _ in seq_lens)
    pairs = sum(visible_keys(q, kv, sliding_window) for q, kv in seq_lens)
    pages = sum(kv_pages_read(q, kv, page_size, sliding_window) for q, kv in seq_lens)
    kv_tokens = pages * page_size
    row_bytes = num_q_heads * head_dim * q_itemsize  # one q row, or one output row
    return RPACost(
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_tokens=num_tokens,
        kv_tokens_read=kv_tokens,
        visible_pairs=pairs,
        q_bytes=num_tokens * row_bytes,
        kv_bytes=kv_tokens * 2 * num_kv_heads * head_dim * kv_itemsize,  # K and V
        out_bytes=num_tokens * row_bytes,
        flops=4 * head_dim * num_q_heads * pairs,
    )


def batch_cost(batch, sliding_window: int | None = None) -> RPACost:
    """`rpa_cost` of a `minilib.batch.RaggedBatch`, with its head config and dtypes.

    >>> from minilib.batch import make_batch
    >>> batch_cost(make_batch([(1, 16)], num_q_heads=2, num_kv_heads=1, head_dim=4)).kv_bytes
    512
    """
    _, num_q_heads, head_dim = batch.q.shape
    _, page_size, combined, _ = batch.kv_pages.shape
    return rpa_cost(
        batch.seq_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=combined // 2,
        head_dim=head_dim,
        page_size=page_size,
        q_itemsize=batch.q.dtype.itemsize,
        kv_itemsize=batch.kv_pages.dtype.itemsize,
        sliding_window=sliding_window,
    )


@dataclasses.dataclass(frozen=True)
class RooflinePoint:
    """Where one batch sits on one chip's roofline.

    >>> cost = rpa_cost([(1024, 1024)], num_q_heads=32, num_kv_heads=8, head_dim=128,
    ...                 page_size=16)                  # one prefill of 1024 tokens
    >>> point = roofline(cost, CHIPS["v5e"])
    >>> point.bound, point.time_s == point.compute_s
    ('compute', True)
    """

    chip: Chip
    cost: RPACost
    memory_s: float  # bytes / bandwidth
    compute_s: float  # useful FLOPs / peak

    @property
    def time_s(self) -> float:
        """The lower bound on the call's time: the slower of the two limits."""
        return max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        """'memory' or 'compute': which limit sets the lower bound."""
        return "memory" if self.memory_s >= self.compute_s else "compute"


def roofline(cost: RPACost, chip: Chip) -> RooflinePoint:
    """Place `cost` on `chip`'s roofline (see `RooflinePoint.time_s`, `.bound`).

    >>> cost = rpa_cost([(1, 1024)], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    >>> point = roofline(cost, CHIPS["v6e"])
    >>> point.bound, round(point.memory_s * 1e6, 2), round(point.compute_s * 1e6, 3)  # us
    ('memory', 2.57, 0.018)
    """
    return RooflinePoint(
        chip=chip,
        cost=cost,
        memory_s=cost.bytes / chip.hbm_bytes_per_s,
        compute_s=cost.flops / chip.peak_flops_per_s,
    )


def explain(point: RooflinePoint) -> str:
    """Why the batch is memory- or compute-bound on this chip, in one paragraph. The roofline
    counts HBM bytes and matmul FLOPs only: the vector and scalar work a kernel issues for
    each byte is not in it (notebook 09 sets one against the other).

    >>> cost = rpa_cost([(1, 1024)], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    >>> print(explain(roofline(cost, CHIPS["v5e"])))  # doctest: +ELLIPSIS
    memory-bound on TPU v5e: 4.0 FLOP/byte is below the ridge point of 240.5 FLOP/byte ...
    as in a decode, each KV byte is used for one q row per head group. ...
    """
    cost, chip = point.cost, point.chip
    relation = "below" if point.bound == "memory" else "above"
    group = cost.num_q_heads // cost.num_kv_heads
    rows = cost.rows_per_kv_token
    reuse = (
        "as in a decode, each KV byte is used for one q row per head group"
        if rows < 2
        else "as in a prefill, each KV byte is used for many q rows"
    )
    return (
        f"{point.bound}-bound on {chip.name}: {cost.intensity:.1f} FLOP/byte is {relation} the "
        f"ridge point of {chip.ridge_point:.1f} FLOP/byte "
        f"({chip.peak_flops_per_s / 1e12:.0f} TFLOP/s / {chip.hbm_bytes_per_s / 1e9:.0f} GB/s). "
        f"Each KV token read serves {rows:.1f} q rows on average, in each of the {group} q "
        f"heads sharing its KV head: {reuse}. Lower bound {point.time_s * 1e6:.1f} us "
        f"(memory {point.memory_s * 1e6:.1f} us, compute {point.compute_s * 1e6:.1f} us)."
    )


def detect_chip() -> Chip | None:
    """The roofline figures of the default device, or None off a TPU.

    On a TPU, JAX's own table is used when this JAX has it (`pltpu.get_tpu_info()`, jax >= 0.8:
    its figures are per TensorCore, so they are multiplied by the device's `num_cores`);
    otherwise, as in jax 0.7.2, the device kind is looked up in CHIPS.

    >>> import jax
    >>> chip = detect_chip()
    >>> chip is None if jax.default_backend() != "tpu" else chip.ridge_point > 0
    True
    """
    import jax

    device = jax.devices()[0]
    if device.platform != "tpu":
        return None
    try:
        from jax.experimental.pallas import tpu as pltpu

        info = pltpu.get_tpu_info()
        return Chip(
            f"TPU {info.chip_version} (pltpu.get_tpu_info)",
            hbm_bytes_per_s=info.mem_bw_bytes_per_second * info.num_cores,
            peak_flops_per_s=info.bf16_ops_per_second * info.num_cores,
        )
    except (ImportError, AttributeError, ValueError):
        key = DEVICE_KINDS.get(device.device_kind)
        return None if key is None else CHIPS[key]

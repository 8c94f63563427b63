"""The workload suite: whole programs of ours and vLLM's RPA v3 on the batches a server runs
and on real models' shapes, and each KV-block loop against its chip's limit (static estimates
from the compiled programs, never timings).

`python -m minilib compile --workloads` compiles every workload of `SUITE` for v5e, v6e and
TPU7x, each kernel at its own default block sizes, and prints whole-program bundles per call
(`minilib.tpu.at_defaults.whole_program`, one counting rule: `COUNTING_RULE`), ours / v3, and
beside them, on v5e and v6e, the **static efficiency** of every KV-block loop the call runs
(`loop_times`): `limit / max(copy, issue)`, where copy is the block's K and V bytes at the
chip's HBM bandwidth, issue its bundles at the chip's clock, and the limit `max(copy, MXU)`,
MXU being the block's matmul FLOPs at the chip's bf16 peak (`minilib.chips`). 100% means the
loop's bundles issue within the time its copy (or its matmuls) must take anyway. TPU7x's clock
is unpublished: there, only the ratio to v3. Bundles are not time: a loop at 100% still waits
for its copy. `modelled_seconds` counts each call in a simple model of time (every bundle at
the clock, plus each KV-block pass's wait on its copy), and the table shows ours fused / v3 so
counted, on v5e and v6e: where both kernels wait on the same copies, as at decode, near 1.

The workloads (`SUITE`): four batches on a Llama-3-8B layer (32 q / 8 KV heads, head_dim 128)
- decode, long-context decode, mixed, prefill-heavy - and the mixed batch on real models'
shapes (`MODELS`), each also with an fp8 cache: Llama-3-8B, gpt-oss-20b (64 q / 8 KV heads,
head_dim 64, attention sinks, a sliding window of 128 tokens) and Gemma 2 9B's global layer
(16 q / 8 KV heads, head_dim 256, logits soft-capped at 50). Page size 16, and a cache of at
least 8192 pages, so that it stays in HBM (`minilib.tpu.kernel_costs`). v3's head_dim-128
kernel has no attention sinks; at head_dim 64 vLLM runs v3's own head_dim-64 kernel, one
kernel with a copy of its KV-block loop per kind of sequence, which the whole-program count
does not follow: gpt-oss has ours alone, and says so.

Compiling the suite takes many minutes, so its results are recorded (`RECORDED`, with the
stack and the date) by `python -m minilib compile --workloads --record`
(`minilib.tpu.at_defaults.record_suite`); `suite_table` prints them (`python -m
minilib.tpu.suite`), and `tests/tpu/test_tpu_suite.py` compiles one workload fresh against the
record.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from minilib.chips import FACTS
from minilib.masking import open_kv_blocks_end
from minilib.tpu.kernel_costs import rpa_specs

__all__ = ["MODELS", "RECORDED", "SUITE", "KVLoop", "LoopTimes", "Model", "Workload",
           "loop_label", "loop_times", "modelled_ratio", "modelled_seconds", "ours_trips",
           "recorded_suite", "suite_table", "v3_trips", "whole_programs"]  # fmt: skip

RECORDED = Path(__file__).with_name("recorded_suite.json")
COMMAND = "python -m minilib compile --workloads --record"
LABEL = "static estimates from the compiled programs, not timings"
MIN_CACHE_PAGES = 8192
EFFICIENCY_CHIPS = ("v5e", "v6e")  # TPU7x: no published clock, so no issue time


@dataclasses.dataclass(frozen=True)
class Model:
    """One attention layer's shapes and options, as a workload compiles them.

    >>> MODELS["gpt-oss"].options(), MODELS["gpt-oss"].fp8().kv_dtype
    ({'sliding_window': 128}, 'fp8')
    >>> MODELS["gemma"].v3_unsupported() is None, MODELS["gpt-oss"].v3_unsupported()[:12]
    (True, 'head_dim 64:')
    """

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str = "bf16"  # the cache's: "bf16" or "fp8"
    sliding_window: int | None = None
    sinks: bool = False
    soft_cap: float | None = None
    page_size: int = 16

    def fp8(self) -> Model:
        return dataclasses.replace(self, name=f"{self.name}, fp8 cache", kv_dtype="fp8")

    def options(self) -> dict:
        """The kernels' keyword options for this layer (sinks go as an argument)."""
        return {k: v for k, v in (("sliding_window", self.sliding_window),
                                  ("soft_cap", self.soft_cap)) if v is not None}  # fmt: skip

    def v3_unsupported(self) -> str | None:
        """Why v3's head_dim-128 kernel (the one the whole-program count follows) cannot run
        this layer, or None."""
        if self.head_dim % 128:
            return (f"head_dim {self.head_dim}: vLLM runs v3's head_dim-64 kernel, whose "
                    "KV-block loop copies per kind of sequence the whole-program count does "
                    "not follow")  # fmt: skip
        if self.sinks:
            return "v3's head_dim-128 kernel has no attention sinks"
        return None


LLAMA = Model("Llama-3-8B", 32, 8, 128)
MODELS = {
    "llama": LLAMA,
    "gpt-oss": Model("gpt-oss-20b", 64, 8, 64, sliding_window=128, sinks=True),
    "gemma": Model("Gemma-2-9B global", 16, 8, 256, soft_cap=50.0),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    """A batch: (q_len, kv_len) per sequence, decode sequences first (v3 wants them first),
    on one model's layer.

    >>> w = Workload("two", ((1, 40), (8, 40)))
    >>> w.tokens, w.pages_per_seq, w.tables()[2].tolist()   # cu_q_lens
    (9, 3, [0, 1, 9])
    """

    name: str
    seqs: tuple[tuple[int, int], ...]
    model: Model = LLAMA

    @property
    def tokens(self) -> int:
        return sum(q for q, _ in self.seqs)

    @property
    def pages_per_seq(self) -> int:
        return math.ceil(max(kv for _, kv in self.seqs) / self.model.page_size)

    def specs(self):
        """Our kernel's argument shapes for this batch: distinct pages for every sequence, in
        a cache of at least `MIN_CACHE_PAGES` pages."""
        m = self.model
        pages = max(MIN_CACHE_PAGES, len(self.seqs) * self.pages_per_seq)
        kv_dtype = jnp.float8_e4m3fn if m.kv_dtype == "fp8" else None
        return rpa_specs(num_q_heads=m.num_q_heads, num_kv_heads=m.num_kv_heads,
                         head_dim=m.head_dim, page_size=m.page_size,
                         pages_per_seq=self.pages_per_seq, max_num_seqs=len(self.seqs),
                         max_num_batched_tokens=self.tokens, num_pages=pages,
                         kv_dtype=kv_dtype)  # fmt: skip

    def tables(self):
        """(kv_lens, page_indices, cu_q_lens, num_seqs) as numpy arrays: distinct pages."""
        q_lens = np.array([q for q, _ in self.seqs], np.int32)
        pages = np.arange(len(self.seqs) * self.pages_per_seq, dtype=np.int32)
        return (np.array([kv for _, kv in self.seqs], np.int32),
                pages.reshape(len(self.seqs), self.pages_per_seq),
                np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                np.array([len(self.seqs)], np.int32))  # fmt: skip

    def distribution(self) -> tuple[int, int, int]:
        """v3's: sequences [0, d) decode, [d, d) prefill-only (none), [d, n) mixed."""
        decode = sum(1 for q, _ in self.seqs if q == 1)
        return decode, decode, len(self.seqs)


MIXED = ((1, 2048),) * 32 + ((256, 1024),) * 2
SUITE = {
    "decode": Workload("64 decodes of 2048 tokens", ((1, 2048),) * 64),
    "long decode": Workload("8 decodes of 32k tokens", ((1, 32768),) * 8),
    "mixed": Workload("32 decodes of 2048 + 2 chunks of 256 on 768 cached", MIXED),
    "prefill": Workload("4 chunks of 1024 on 0, 1k, 2k, 3k cached",
                        tuple((1024, 1024 * (i + 1)) for i in range(4))),
    "llama fp8": Workload("mixed, fp8 cache", MIXED, LLAMA.fp8()),
    "gpt-oss": Workload("mixed", MIXED, MODELS["gpt-oss"]),
    "gpt-oss fp8": Workload("mixed, fp8 cache", MIXED, MODELS["gpt-oss"].fp8()),
    "gemma": Workload("mixed", MIXED, MODELS["gemma"]),
    "gemma fp8": Workload("mixed, fp8 cache", MIXED, MODELS["gemma"].fp8()),
}  # fmt: skip


# Trip counts, from the batch. -------------------------------------------------------------------


def ours_trips(workload: Workload, pages: int, queries: int,
               open_blocks: bool = False) -> dict[str, list]:  # fmt: skip
    """Per kernel of ours ("decode", "mixed"): passes of its KV-block loop, its sequence loop
    and its grid loop, read from `minilib.schedule.plan_schedule` (the kernel's own walk, the
    layer's sliding window included). A grid of one step compiles to no loop: then there is no
    grid loop to count. With `open_blocks` (`minilib.kernel.open_blocks`), each kernel's
    KV-block passes are a pair: of its loop of open blocks, and of its masked loop.

    >>> w = Workload("two", ((1, 40), (8, 40)))
    >>> ours_trips(w, pages=1, queries=8)  # 8 rows, 1 q block
    {'decode': [3, 1], 'mixed': [3, 1, 2]}
    >>> ours_trips(w, pages=1, queries=8, open_blocks=True)  # keys 0..31 seen by all rows
    {'decode': [(2, 1), 1], 'mixed': [(2, 1), 1, 2]}
    """
    from minilib.schedule import plan_schedule

    q, kv_pages, *_ = workload.specs()
    tables, window = workload.tables(), workload.model.sliding_window
    s = plan_schedule(q, kv_pages, *tables, num_kv_pages_per_block=pages,
                      num_queries_per_block=queries, sliding_window=window)  # fmt: skip
    kv_lens = tables[0]

    def is_open(e) -> bool:
        if e.kernel == "decode":  # its one row, the sequence's own
            rows = seq_rows = (0, 1)
        else:
            rows = (e.step[1] * queries, (e.step[1] + 1) * queries)
            seq_rows = s.mixed_q_rows[e.seq]
        end = open_kv_blocks_end(rows, seq_rows, int(kv_lens[e.seq]), s.kv_tokens_per_block,
                                 window)  # fmt: skip
        return e.kv_blk < int(end)

    trips = {}
    for kernel, grid in (("decode", s.decode_grid), ("mixed", s.grid)):
        work = [e for e in s.computes() if e.kernel == kernel]
        steps = [math.prod(grid)] if math.prod(grid) > 1 else []
        passes = len(work)
        if open_blocks:
            opened = sum(map(is_open, work))
            passes = (opened, len(work) - opened)
        trips[kernel] = [passes, len({(e.step, e.seq) for e in work}), *steps]
    return trips


def v3_trips(workload: Workload, blocks: dict[str, dict]) -> dict[str, tuple[list[int], int]]:
    """Per kernel of v3 ("decode", "mixed"): (passes of its KV-block loop and of the loops
    around it, outward; passes of its compute-chunk loop), from the batch as v3's kernel walks
    it (`v3/kernel.py`: sequences of its range, q blocks, KV blocks up to the causal end, chunks
    of `bkv_csz`). Its decode kernel has one q block per sequence, so no q-block loop.

    >>> w = Workload("two", ((1, 40), (8, 40)))
    >>> b = dict(bq_sz=4, bkv_sz=32, bq_csz=4, bkv_csz=16)
    >>> v3_trips(w, {"decode": b, "mixed": b})
    {'decode': ([2, 1], 3), 'mixed': ([4, 2, 1], 6)}
    """
    if workload.model.sliding_window is not None:
        raise ValueError("v3_trips counts no sliding window: its KV blocks would start later")
    decode, _, num_seqs = workload.distribution()
    trips = {}
    for kernel, (first, end) in (("decode", (0, decode)), ("mixed", (decode, num_seqs))):
        b = blocks[kernel]
        kv_passes = q_passes = chunks = 0
        for q_len, kv_len in workload.seqs[first:end]:
            bq = 1 if kernel == "decode" else b["bq_sz"]
            for bq_idx in range(-(-q_len // bq)):
                q_passes += 1
                effective = min(kv_len, kv_len - q_len + (bq_idx + 1) * bq)
                for bkv_idx in range(-(-effective // b["bkv_sz"])):
                    kv_passes += 1
                    size = min(effective - bkv_idx * b["bkv_sz"], b["bkv_sz"])
                    chunks += -(-size // b["bkv_csz"])
        outward = [kv_passes] + ([] if kernel == "decode" else [q_passes]) + [end - first]
        trips[kernel] = (outward, chunks)
    return trips


# Each KV-block loop against its limit. ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KVLoop:
    """One KV-block loop a call runs: its bundles per KV block (`COUNTING_RULE`; v3's compute
    chunks counted once per chunk of the block), the block's KV tokens and KV heads, the q
    tokens one pass serves, and its passes in the call.

    >>> KVLoop("ours", "mixed", 2749, kv_tokens=512, kv_heads=8, q_tokens=32, passes=32).passes
    32
    """

    kernel: str  # "ours" or "v3"
    program: str  # "decode" or "mixed", or their open KV blocks' loops: "decode open", "open"
    bundles: int
    kv_tokens: int
    kv_heads: int
    q_tokens: int
    passes: int


@dataclasses.dataclass(frozen=True)
class LoopTimes:
    """One pass of a KV-block loop, three ways (static estimates: no stalls, no DMA queueing):
    its bundles at the chip's clock (issue; None without a published clock), its K and V bytes
    at the HBM bandwidth (copy), its matmul FLOPs at the bf16 peak (MXU).

    >>> t = LoopTimes(issue_s=2e-6, copy_s=1e-6, mxu_s=0.5e-6)   # issue-bound
    >>> t.limit_s, t.efficiency
    (1e-06, 0.5)
    >>> LoopTimes(None, 1e-6, 0.5e-6).efficiency is None          # no published clock
    True
    """

    issue_s: float | None
    copy_s: float
    mxu_s: float

    @property
    def limit_s(self) -> float:
        return max(self.copy_s, self.mxu_s)

    @property
    def efficiency(self) -> float | None:
        """limit / max(copy, issue): 1.0 when the bundles issue within the copy's time."""
        return None if self.issue_s is None else self.limit_s / max(self.copy_s, self.issue_s)


def loop_times(loop: KVLoop, model: Model, chip: str) -> LoopTimes:
    """`LoopTimes` of `loop` on `chip`, for `model`'s layer.

    A decode block of 512 tokens of Llama-3-8B (8 KV heads, bf16: 2 MiB of K and V) in a loop
    of 1,100 bundles, on v5e (1.5 GHz, 819 GB/s):

    >>> t = loop_times(KVLoop("ours", "decode", 1100, 512, 8, 1, 1), LLAMA, "v5e")
    >>> round(t.copy_s * 1e6, 2), round(t.issue_s * 1e6, 2), round(t.mxu_s * 1e9, 1)
    (2.56, 0.73, 42.6)
    >>> t.efficiency
    1.0
    """
    facts = FACTS[chip]
    group = model.num_q_heads // model.num_kv_heads
    itemsize = 1 if model.kv_dtype == "fp8" else 2
    kv_bytes = loop.kv_tokens * 2 * loop.kv_heads * model.head_dim * itemsize
    flops = 4 * loop.q_tokens * group * loop.kv_heads * loop.kv_tokens * model.head_dim
    issue_s = None if facts.clock_hz is None else loop.bundles / facts.clock_hz
    return LoopTimes(issue_s, kv_bytes / facts.hbm_bytes_per_s, flops / facts.peak_flops_per_s)


def modelled_seconds(figures: dict, model: Model, chip: str) -> float | None:
    """One kernel's call in a simple model (a static estimate, not a timing): every bundle of
    its whole program at the chip's clock, plus, for each pass of a KV-block loop whose copy
    outlasts its bundles, the difference: the time that pass waits on HBM. `figures`: the
    kernel's recorded parts and loops. XLA's programs count as their bundles alone (their HBM
    traffic is not modelled). None where the chip's clock is unpublished (TPU7x).

    A program of 3,000 bundles whose decode loop (1,100 bundles, 512 tokens of Llama-3-8B:
    2.56 us of copy) runs twice, on v5e (1.5 GHz): 2 us of bundles, and each pass waits
    2.56 - 0.73 us on its copy:

    >>> loop = KVLoop("ours", "decode", 1100, kv_tokens=512, kv_heads=8, q_tokens=1, passes=2)
    >>> figures = {"parts": [["a kernel", 3000, ""]], "loops": [dataclasses.asdict(loop)]}
    >>> round(modelled_seconds(figures, LLAMA, "v5e") * 1e6, 2)
    5.65
    """
    clock_hz = FACTS[chip].clock_hz
    if clock_hz is None:
        return None
    waits = 0.0
    for loop in [KVLoop(**loop) for loop in figures["loops"]]:
        t = loop_times(loop, model, chip)
        waits += loop.passes * max(0.0, t.copy_s - t.issue_s)
    return total(figures["parts"]) / clock_hz + waits


# The record, and the table. ---------------------------------------------------------------------


def recorded_suite(path: Path = RECORDED) -> dict:
    """The record `minilib.tpu.at_defaults.record_suite` wrote: stack, date, results.

    >>> record = recorded_suite()
    >>> sorted(record["results"]), list(record["results"]["v5e"]) == list(SUITE)
    (['tpu7x', 'v5e', 'v6e'], True)
    """
    return json.loads(path.read_text())


def total(parts) -> int:
    """A kernel's whole-program bundles: the sum of its parts' [part, bundles, how]."""
    return sum(n for _, n, _ in parts)


def efficiencies(result: dict, kernel: str, model: Model, chip: str) -> list[tuple[str, float]]:
    """[(program, static efficiency)] of each KV-block loop of `kernel` the call runs."""
    loops = [KVLoop(**loop) for loop in result[kernel]["loops"]]
    return [(loop.program, loop_times(loop, model, chip).efficiency)
            for loop in loops if loop.passes > 0]  # fmt: skip


def whole_programs(result: dict) -> dict[str, int | None]:
    """A workload's whole-program bundles: "ours" (attention alone), "ours + scatter" (then the
    separate scatter of the new tokens), "ours fused" (the kernels writing them), "v3" (which
    always writes them); None where there is none. The last three are like for like.

    >>> figures = whole_programs(recorded_suite()["results"]["v5e"]["mixed"])
    >>> list(figures), figures["ours + scatter"] > figures["ours"]
    (['ours', 'ours + scatter', 'ours fused', 'v3'], True)
    """
    ours = total(result["ours"]["parts"])
    scatter = total(result["scatter"]["parts"]) if "scatter" in result else None
    fused = result.get("ours fused", {})
    return {"ours": ours, "ours + scatter": None if scatter is None else ours + scatter,
            "ours fused": total(fused["parts"]) if "parts" in fused else None,
            "v3": total(result["v3"]["parts"]) if "parts" in result["v3"] else None}  # fmt: skip


def loop_label(program: str) -> str:
    """A KV-block loop's name in the table: the initials of its program's.

    >>> [loop_label(p) for p in ("decode", "decode open", "open", "mixed")]
    ['d', 'do', 'o', 'm']
    """
    return "".join(word[0] for word in program.split())


def modelled_ratio(result: dict, model: Model, chip: str) -> float | None:
    """Ours fused / v3 in `modelled_seconds` (the table's time/v3); None without both.

    >>> round(modelled_ratio(recorded_suite()["results"]["v6e"]["prefill"], LLAMA, "v6e"), 2)
    0.75
    """
    if chip not in EFFICIENCY_CHIPS or "parts" not in result["v3"]:
        return None
    fused, v3 = (modelled_seconds(result[k], model, chip) for k in ("ours fused", "v3"))
    return fused / v3


def suite_table(record: dict) -> str:
    """The suite's results (`record_suite`'s, or live ones shaped alike) as a table: per chip
    and workload, whole-program bundles of ours (alone, + the separate scatter, with the write
    fused), of v3, each of ours / v3, and on v5e and v6e the static efficiency of each
    KV-block loop of ours (and v3's).

    >>> print(suite_table(recorded_suite()).splitlines()[0])
    Whole-program bundles per call, each kernel at its own block sizes: static estimates ...
    """
    lines = [f"Whole-program bundles per call, each kernel at its own block sizes: {LABEL} "
             f"(libtpu {record['libtpu']}, v3 {record['v3']}). v3 writes the new tokens' K/V "
             "into the cache: like for like with it are ours + scatter (the separate scatter, "
             "write_tokens) and ours fused (the write in our kernels); ours alone writes none. "
             "Both are given the new K/V in bf16 and cast them to an fp8 cache's dtype. "
             "Time/v3: ours fused / v3 in a simple model, on v5e and v6e (`modelled_seconds`: "
             "every bundle at the clock, plus each KV-block pass's wait on its copy; also a "
             "static estimate). Efficiency: limit / max(copy, issue) per KV-block loop, d = "
             "decode kernel, do = its open KV blocks (no mask), m = mixed kernel, o = its open "
             "KV blocks.",
             f"{'chip':6} {'workload':12} {'model':26} {'ours':>11} {'+ scatter':>11} "
             f"{'fused':>11} {'v3':>11} {'ours/v3':>7} {'+sc/v3':>7} {'fused/v3':>8} "
             f"{'time/v3':>7}  {'efficiency ours':17} {'efficiency v3':13}"]  # fmt: skip
    for chip, results in record["results"].items():
        for name, result in results.items():
            model = SUITE[name].model
            figures = whole_programs(result)
            v3 = figures["v3"]
            counts = " ".join(f"{n:11,}" if n else f"{'-':>11}" for n in figures.values())
            ratios = " ".join(f"{figures[k] / v3:{w}.2f}" if v3 and figures[k] else f"{'-':>{w}}"
                              for k, w in (("ours", 7), ("ours + scatter", 7),
                                           ("ours fused", 8)))  # fmt: skip
            timed = modelled_ratio(result, model, chip)
            ratios += f" {timed:7.2f}" if timed else f" {'-':>7}"
            cells = []
            for kernel in ("ours", "v3"):
                if chip not in EFFICIENCY_CHIPS or "loops" not in result[kernel]:
                    cells.append("-")
                    continue
                found = efficiencies(result, kernel, model, chip)
                cells.append(" ".join(f"{loop_label(p)} {e:.0%}" for p, e in found))
            lines.append(f"{chip:6} {name:12} {model.name:26} {counts} {ratios}"
                         f"  {cells[0]:17} {cells[1]:13}".rstrip())  # fmt: skip
    notes = {result["v3"]["unsupported"] for results in record["results"].values()
             for result in results.values() if "unsupported" in result["v3"]}  # fmt: skip
    lines += [f"v3 -: {note}." for note in sorted(notes)]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m minilib.tpu.suite: the recorded suite's table
    print(suite_table(recorded_suite()))

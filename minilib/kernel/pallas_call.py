"""The `pallas_call` of one kernel: what runs, on which grid, with which memory.

`rpa_pallas_call` builds it: the grid (heads blocks, q blocks), q and the output in blocks that
Pallas copies, `kv_pages` left in HBM for the kernel to copy, the VMEM scratch, and the levers'
points (`levers.choose_points`). `call.run_kernels` calls it once per kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.kernel.config import KERNEL_NAMES, LANES, KernelConfig
from minilib.kernel.kv_write import with_kv_write
from minilib.kernel.levers import choose_points
from minilib.kernel.page_table import block_page_table
from minilib.kernel.plain import Points, rpa_kernel
from minilib.kernel.tracing import with_trace
from minilib.kernel_trace import TRACE_FIELDS

__all__ = ["TABLE_NAMES", "rpa_pallas_call"]

# The scalar-prefetched tables, by the names `plain.rpa_kernel` takes them by.
TABLE_NAMES = ("kv_lens_ref", "page_indices_ref", "cu_q_lens_ref", "num_seqs_ref")


def rpa_pallas_call(
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]; shape and dtype
    kv_pages,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]; shape and dtype
    *,
    config: KernelConfig,
    interpret=False,
    trace_capacity: int = 0,
    attention_sink: bool = False,
    write_kv: bool = False,
    points: Points | None = None,
):
    """Build the `pallas_call`. Called with (kv_lens, page_indices, cu_q_lens, num_seqs, q,
    kv_pages), and the sinks of `sink_input` after them if `attention_sink`; returns (out,)
    or, with `trace_capacity > 0`, (out, trace).

    The sinks are a VMEM input, in blocks of the heads block's KV heads, [kvh_per_blk, group,
    LANES], which Pallas copies in once per heads block (the block index changes only with
    it). Why VMEM, not SMEM: they are used as vectors, a lane-replicated column beside l and
    m; from SMEM each q head's sink would be a scalar to broadcast and select into its rows.
    Without sinks there is no such input, and the kernel body gets `sink_ref=None`.

    With `write_kv`, the call takes the new tokens last, [rows, 2*num_kv_heads, head_dim] in
    HBM, packed as the batch packs them, then their cu_q_lens (SMEM; the mixed kernel's q has
    a layout of its own), and returns the cache last, aliased to its kv_pages input: the
    kernel writes the tokens into it first (`kv_write.with_kv_write`).

    The tables must be those of a valid batch, or clamped by `clamp_tables` (as the
    jitted wrapper of `ragged_paged_attention` does): the kernel reads them as they are, and
    its page copies are not bounds-checked.

    The levers are those of `config.levers`, their points chosen by `levers.choose_points`;
    `points` replaces them (the tests pass a copier with a deliberate bug, to show that their
    checks catch it).

    trace: i32[1 + trace_capacity, TRACE_FIELDS]; `trace[0, 0]` counts the events, which are
    rows 1.. of (kind, step heads block, step q block, heads block, seq, kv block, slot). The
    kernel records them through a wrapper (`tracing.with_trace`). The kernel body takes each
    ref by name (`plain.rpa_kernel`): the sinks as `sink_ref`, the trace as `trace_ref`.

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config, resolve_interpret
    >>> batch = make_batch([(3, 3), (1, 9)])
    >>> config = kernel_config(batch.q, batch.kv_pages, batch.page_indices)
    >>> call = rpa_pallas_call(batch.q, batch.kv_pages, config=config,
    ...                        interpret=resolve_interpret(True))
    >>> (out,) = call(batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs,
    ...               batch.q, batch.kv_pages)
    >>> out.shape == batch.q.shape
    True
    """
    max_num_batched_tokens, _, head_dim = q.shape
    c = config
    points = points or choose_points(c)
    num_q_blocks = pl.cdiv(max_num_batched_tokens, c.num_queries_per_block)
    # Each ref of the kernel by the name `plain.rpa_kernel` takes it by, in pallas_call's order.
    inputs = kernel_inputs(c, head_dim, attention_sink=attention_sink, write_kv=write_kv)
    outputs = kernel_outputs(q, kv_pages, c, trace_capacity=trace_capacity, write_kv=write_kv)
    scratch = kernel_scratch(c, points, q_dtype=q.dtype, kv_dtype=kv_pages.dtype, write_kv=write_kv)
    names = [*TABLE_NAMES, *inputs, *outputs, *scratch]
    body = functools.partial(rpa_kernel, config=c)
    if trace_capacity:
        body = with_trace(body, trace_capacity, points)
    else:
        body = functools.partial(body, points=points)
    aliases = {}
    if write_kv:
        body = with_kv_write(body, c, points.seq_table)
        cache_in = len(TABLE_NAMES) + list(inputs).index("kv_pages_hbm_ref")
        aliases = {cache_in: list(outputs).index("kv_pages_out_ref")}

    def kernel(*refs):
        body(**dict(zip(names, refs, strict=True)))

    call = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(TABLE_NAMES),
            grid=(c.num_heads_blocks, num_q_blocks),
            in_specs=list(inputs.values()),
            out_specs=[spec for spec, _ in outputs.values()],
            scratch_shapes=list(scratch.values()),
        ),
        compiler_params=pltpu.CompilerParams(
            # "arbitrary": the grid runs in order on one core, because each step starts the
            # copy that the next step waits for.
            dimension_semantics=("arbitrary", "arbitrary"),
            vmem_limit_bytes=c.vmem_limit_bytes,
            # No bounds check on each copy (a serial chain of scalar compares and a halt per
            # page copy): the tables are clamped (`clamp_tables`), so every copy is inside
            # kv_pages already. vLLM's RPA v3 drops them too.
            disable_bounds_checks=True,
        ),
        out_shape=[shape for _, shape in outputs.values()],
        input_output_aliases=aliases,
        interpret=interpret,
        name=KERNEL_NAMES["decode" if c.decode else "mixed"],
    )
    # The page table as the page copies read it (`page_table.block_page_table`).
    return lambda kv_lens, pages, *rest: call(kv_lens, block_page_table(kv_lens, pages, c), *rest)


def q_blocks(config: KernelConfig, head_dim: int) -> pl.BlockSpec:
    """q and the output in blocks of `num_queries_per_block` rows and a heads block, which
    Pallas copies between HBM and VMEM: grid step (heads_blk, q_blk) gets block (q_blk,
    heads_blk)."""
    c = config
    block = (c.num_queries_per_block, c.num_q_heads_per_block, head_dim)
    return pl.BlockSpec(block, lambda heads_blk, q_blk, *_: (q_blk, heads_blk, 0))


def kernel_inputs(config: KernelConfig, head_dim: int, *, attention_sink: bool, write_kv: bool):
    """{name: BlockSpec} of the inputs after the scalar-prefetched tables: q, the cache left
    in HBM (the kernel copies the pages), the sinks if any, the new tokens if written."""
    c = config
    inputs = {
        "q_ref": q_blocks(c, head_dim),
        "kv_pages_hbm_ref": pl.BlockSpec(memory_space=pl.ANY),
    }
    if attention_sink:
        sink_block = (c.num_kv_heads_per_block, c.num_q_heads_per_kv_head, LANES)
        inputs["sink_ref"] = pl.BlockSpec(sink_block, lambda heads_blk, *_: (heads_blk, 0, 0))
    if write_kv:
        inputs["new_kv_hbm_ref"] = pl.BlockSpec(memory_space=pl.ANY)
        inputs["new_kv_cu_q_lens_ref"] = pl.BlockSpec(memory_space=pltpu.SMEM)
    return inputs


def kernel_outputs(q, kv_pages, config: KernelConfig, *, trace_capacity: int, write_kv: bool):
    """{name: (BlockSpec, shape)} of the outputs: the attention output in q's blocks, the
    trace in SMEM if any, the cache (aliased to its input) if the new tokens are written."""
    head_dim = q.shape[-1]
    outputs = {"o_ref": (q_blocks(config, head_dim), jax.ShapeDtypeStruct(q.shape, q.dtype))}
    if trace_capacity:
        trace_shape = jax.ShapeDtypeStruct((1 + trace_capacity, TRACE_FIELDS), jnp.int32)
        outputs["trace_ref"] = (pl.BlockSpec(memory_space=pltpu.SMEM), trace_shape)
    if write_kv:
        cache_shape = jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype)
        outputs["kv_pages_out_ref"] = (pl.BlockSpec(memory_space=pl.ANY), cache_shape)
    return outputs


def kernel_scratch(config: KernelConfig, points: Points, *, q_dtype, kv_dtype, write_kv: bool):
    """{name: scratch shape}: memory the kernel owns across grid steps. In VMEM the two KV
    slots (as `points.slot` lays them out), the softmax state and q folded into rows; two DMA
    semaphores, one per slot (and one for the writes); in SMEM the slot the next KV block is
    loading into."""
    c = config
    rows = c.rows_per_kv_head
    state = (c.num_kv_heads_per_block, rows, LANES)
    rows_by_head_dim = (c.num_kv_heads_per_block, rows, c.head_dim)
    scratch = {
        "kv_bufs": points.slot.scratch(c, kv_dtype),
        "sems": pltpu.SemaphoreType.DMA((2,)),
        "m_ref": pltpu.VMEM(state, jnp.float32),
        "l_ref": pltpu.VMEM(state, jnp.float32),
        "acc_ref": pltpu.VMEM(rows_by_head_dim, jnp.float32),
        "q_fold_ref": pltpu.VMEM(rows_by_head_dim, q_dtype),
        "slot_ref": pltpu.SMEM((1,), jnp.int32),
    }
    if write_kv:
        scratch["write_sem"] = pltpu.SemaphoreType.DMA((1,))
    return scratch

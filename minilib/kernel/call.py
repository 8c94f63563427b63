"""The entry point and the `pallas_call`: what runs, on which grid, with which memory.

`ragged_paged_attention` checks the inputs and builds the `KernelConfig`; the jitted wrapper,
`rpa_jit`, clamps the batch tables once (`clamp_tables`) and runs the two kernels (decode, then
mixed); `rpa_pallas_call` builds each `pallas_call`: the grid (heads blocks, q blocks), q and
the output in blocks that Pallas copies, `kv_pages` left in HBM for the kernel to copy, the VMEM
scratch, and the levers' points (`levers.choose_points`).

The mixed kernel gets a q of its own (`mixed_layout`), not the batch's: the one-token
sequences take no rows there (the decode kernel serves them), and each other sequence starts
on a q block while the padding fits, its padding rows before its own. A q block costs the same
whether a sequence fills it or not, and each (q block, sequence) pair runs all the KV blocks
its rows see: a chunk that starts mid-block pays for one more pair. q is gathered into that
layout, and the output gathered back.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.block_sizes import (
    default_block_sizes,
    default_decode_seqs_per_block,
    default_vmem_limit,
    num_kv_heads_per_block,
)
from minilib.chips import current_chip
from minilib.errors import RPAInputError
from minilib.kernel.config import KERNEL_NAMES, LANES, KernelConfig
from minilib.kernel.decode import decode_batch
from minilib.kernel.kv_write import with_kv_write
from minilib.kernel.levers import (
    bounded_scores,
    can_fold_q_strided,
    can_load_kv_strided,
    choose_points,
    slot_levers,
    split_configs,
    walker_class,
    with_head_pipeline,
)
from minilib.kernel.page_table import block_page_table
from minilib.kernel.plain import KVBlockCopier, rpa_kernel
from minilib.kernel.tracing import with_trace
from minilib.kernel_trace import TRACE_FIELDS
from minilib.kv_cache import combine_kv
from minilib.options import DEFAULT_MASK_VALUE, AttentionOptions, attention_options
from minilib.validation import check_new_kv, validate_inputs

__all__ = [
    "clamp_tables",
    "kernel_config",
    "mixed_layout",
    "ragged_paged_attention",
    "resolve_interpret",
    "rpa_jit",
    "rpa_pallas_call",
    "rpa_write_jit",
]


def ragged_paged_attention(
    q: jax.Array,  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    page_indices: jax.Array,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = DEFAULT_MASK_VALUE,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    interpret=None,
    validate: bool = True,
    attention_sink: jax.Array | None = None,  # f32[num_q_heads]
    new_keys: jax.Array | None = None,  # [max_num_batched_tokens, num_kv_heads, head_dim]
    new_values: jax.Array | None = None,  # [max_num_batched_tokens, num_kv_heads, head_dim]
):  # out [max_num_batched_tokens, num_q_heads, head_dim]; with new K/V, (out, kv_pages)
    """Ragged paged attention on a TPU, or on CPU in Pallas' TPU interpret mode.

    Same arguments as JAX's `ragged_paged_attention`, plus `interpret`:
      None: compile for the chip when `jax.default_backend() == "tpu"`, else interpret;
      False: compile; True or a `pltpu.InterpretParams`: interpret (True means the defaults).

    Returns an array shaped like `q`; rows past `cu_q_lens[num_seqs]` are zeros. The block
    sizes default to `default_block_sizes`, `vmem_limit_bytes` to `default_vmem_limit`. An
    fp8 `kv_pages` without `k_scale` and `v_scale` is taken as scale 1, with no error or
    warning (as in JAX's kernel): pass the scales the cache was quantized with.
    `attention_sink` (f32[num_q_heads], or None): one more softmax logit per q head, with no
    value, as in `ref_ragged_paged_attention`, in the denominator of each output row.

    `new_keys` and `new_values` (both, or neither, the default): this step's new tokens, row
    i the K and V of q row i. Sequence s's rows cu_q_lens[s]..cu_q_lens[s+1] go to positions
    kv_lens[s] - q_len .. kv_lens[s] - 1 of its pages, written by the kernels before they
    read them (`kv_write`), cast to the cache's dtype as `write_tokens` does. Then the call
    returns (out, the updated kv_pages), and `kv_pages` is donated: the update is made in
    its buffer, which must not be used after the call (pass a copy to keep the old cache).

    Called eagerly, it checks the inputs' values first (`dynamic_validate_inputs`; not with
    `validate=False`); under `jax.jit` only the static checks run: validate outside, as JAX.

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(3, 3), (1, 9)])
    >>> ragged_paged_attention(*batch.args(), sm_scale=0.125).shape
    (4, 4, 64)
    >>> new_k = new_v = jnp.ones((4, 2, 64), batch.q.dtype)       # written into the cache
    >>> out, kv_pages = ragged_paged_attention(*batch.args(), new_keys=new_k, new_values=new_v)
    >>> kv_pages[batch.page_indices[0, 0], :3, 0, 0].tolist()    # sequence 0's 3 tokens
    [1.0, 1.0, 1.0]
    """
    options = AttentionOptions(
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, mask_value=mask_value,
        k_scale=k_scale, v_scale=v_scale, num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block, vmem_limit_bytes=vmem_limit_bytes,
    )  # fmt: skip
    args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    validate_inputs(*args, options, validate=validate, attention_sink=attention_sink)
    config = kernel_config(q, kv_pages, page_indices, options)
    interpret = resolve_interpret(interpret)
    if new_keys is not None or new_values is not None:
        check_new_kv(new_keys, new_values, q, kv_pages)
        out, kv_pages, _ = rpa_write_jit(
            *args, new_keys, new_values, attention_sink, config=config, interpret=interpret,
            trace_capacity=0,
        )  # fmt: skip
        return out, kv_pages
    out, _ = rpa_jit(*args, attention_sink, config=config, interpret=interpret, trace_capacity=0)
    return out


def resolve_interpret(interpret):
    """What to pass to `pl.pallas_call(interpret=...)`: False on a TPU, else TPU interpret mode.

    Only `jax.default_backend()` is consulted, never `jax.devices()`, so that lowering for a
    TPU on a machine without one (`jax.export`) takes the compiled path when asked to.

    >>> resolve_interpret(False), type(resolve_interpret(True)).__name__
    (False, 'InterpretParams')
    """
    if interpret is None:
        return False if jax.default_backend() == "tpu" else pltpu.InterpretParams()
    if interpret is True:
        return pltpu.InterpretParams()
    if interpret is False or isinstance(interpret, pltpu.InterpretParams):
        return interpret
    raise RPAInputError(
        f"interpret={interpret!r} is not an interpret mode",
        "pass None (compiled on a TPU, TPU interpret mode elsewhere), True (TPU interpret "
        "mode), False (compiled: needs a TPU, or jax.export for one), or "
        "pltpu.InterpretParams(...)",
    )


def kernel_config(
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]; only shape and dtype are used
    kv_pages,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]; shape and dtype
    page_indices,  # i32[max_num_seqs, pages_per_seq]; shape
    options: AttentionOptions | None = None,
    **option_values,
) -> KernelConfig:
    """Choose the heads blocks and fill in default block sizes. Inputs must be validated.

    The options come as one `AttentionOptions`, or as keywords (`num_queries_per_block=8`).

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(5, 20)], num_q_heads=8, num_kv_heads=2, page_size=16)
    >>> config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, sliding_window=64)
    >>> config.sliding_window, config.num_heads_blocks * config.num_kv_heads_per_block
    (64, 2)
    """
    options = attention_options(options, **option_values)
    max_num_batched_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_combined_kv_heads, _ = kv_pages.shape
    num_kv_heads = num_combined_kv_heads // 2
    max_num_seqs, pages_per_seq = page_indices.shape
    kv_heads_per_block = num_kv_heads_per_block(num_q_heads, num_kv_heads, q.dtype, kv_pages.dtype)
    default_pages, default_queries = default_block_sizes(
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        max_num_batched_tokens=max_num_batched_tokens,
        bytes_per_page=page_size * 2 * kv_heads_per_block * head_dim * kv_pages.dtype.itemsize,
        head_dim=head_dim,
        num_q_heads_per_block=kv_heads_per_block * (num_q_heads // num_kv_heads),
        q_itemsize=q.dtype.itemsize,
        vmem_limit_bytes=options.vmem_limit_bytes,
        sliding_window=options.sliding_window,
    )
    asked = default_vmem_limit(options.num_kv_pages_per_block, options.num_queries_per_block)
    options = dataclasses.replace(
        options,
        num_queries_per_block=options.num_queries_per_block or default_queries,
        num_kv_pages_per_block=options.num_kv_pages_per_block or default_pages,
        vmem_limit_bytes=options.vmem_limit_bytes or asked,
    )
    q_heads_per_block = kv_heads_per_block * (num_q_heads // num_kv_heads)
    bytes_per_q_row = q_heads_per_block * head_dim * q.dtype.itemsize  # of one heads block
    config = KernelConfig(
        **dataclasses.asdict(options),
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_heads_blocks=num_kv_heads // kv_heads_per_block,
        num_kv_heads_per_block=kv_heads_per_block,
        num_q_heads_per_kv_head=num_q_heads // num_kv_heads,
        head_dim=head_dim,
        q_itemsize=q.dtype.itemsize,
        kv_itemsize=kv_pages.dtype.itemsize,
        decode_seqs_per_block=default_decode_seqs_per_block(max_num_seqs, bytes_per_q_row),
        **slot_levers(head_dim, current_chip()),  # padded_slot, narrow_rows, ...
        bounded_scores=bounded_scores(options.soft_cap, options.mask_value),
    )
    return with_head_pipeline(config)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "trace_capacity"))
def rpa_jit(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, attention_sink=None, *, config,
    interpret, trace_capacity,
):  # fmt: skip
    """The two kernels on one batch: the decode kernel on its one-token sequences (gathered
    into a batch of their own), the mixed kernel on the others (in its own q, `mixed_layout`);
    the output gathered back from the mixed kernel's, the decode rows scattered into it.
    Returns (out, None), or with `trace_capacity > 0` (out, (decode trace, mixed trace)).

    The batch tables are clamped here, once (`clamp_tables`): under `jit` nothing has
    validated them, and the kernels read them as they are.

    `attention_sink` (f32[num_q_heads] or None) goes to both kernels as `sink_input` makes it.

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(3, 3), (1, 9)])
    >>> config = kernel_config(batch.q, batch.kv_pages, batch.page_indices)
    >>> out, traces = rpa_jit(*batch.args(), config=config, interpret=resolve_interpret(True),
    ...                       trace_capacity=0)
    >>> out.shape == batch.q.shape, traces
    (True, None)
    """
    out, _, traces = run_kernels(
        q, kv_pages, (kv_lens, page_indices, cu_q_lens, num_seqs), attention_sink, None,
        config=config, interpret=interpret, trace_capacity=trace_capacity,
    )  # fmt: skip
    return out, traces


@functools.partial(
    jax.jit, static_argnames=("config", "interpret", "trace_capacity"), donate_argnames="kv_pages"
)
def rpa_write_jit(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, new_keys, new_values,
    attention_sink=None, *, config, interpret, trace_capacity,
):  # fmt: skip
    """`rpa_jit` with the new tokens' K and V written into the cache by the kernels
    (`kv_write`): returns (out, the updated kv_pages, traces). `kv_pages` is donated, and
    each kernel's cache output aliases its input, so no copy of the cache is made.

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(2, 5)])
    >>> config = kernel_config(batch.q, batch.kv_pages, batch.page_indices)
    >>> new_k = new_v = jnp.zeros((2, 2, 64))
    >>> out, kv_pages, _ = rpa_write_jit(*batch.args(), new_k, new_v, config=config,
    ...                                  interpret=resolve_interpret(True), trace_capacity=0)
    >>> kv_pages[batch.page_indices[0, 0], 3:5, 0, 0].tolist()   # positions 3 and 4
    [0.0, 0.0]
    """
    new_kv = combine_kv(new_keys, new_values, kv_pages.dtype)
    return run_kernels(
        q, kv_pages, (kv_lens, page_indices, cu_q_lens, num_seqs), attention_sink, new_kv,
        config=config, interpret=interpret, trace_capacity=trace_capacity,
    )  # fmt: skip


def run_kernels(q, kv_pages, tables, attention_sink, new_kv, *, config, interpret, trace_capacity):
    """The body of `rpa_jit` and `rpa_write_jit`: (out, kv_pages, traces); without `new_kv`
    ([max_num_batched_tokens, 2*num_kv_heads, head_dim] or None) the cache is returned as
    given. The decode kernel writes its sequences' tokens, the mixed kernel the others'."""
    tables = clamp_tables(*tables, config, total_num_pages=kv_pages.shape[0])
    mixed_config, decode_config = split_configs(config)
    decode = decode_batch(*tables, config)
    q_decode = jnp.take(q, decode.rows, axis=0, mode="clip")  # [max_num_seqs, heads, hd]
    sink = () if attention_sink is None else (sink_input(attention_sink, config),)
    write = new_kv is not None
    decode_call = rpa_pallas_call(
        q_decode, kv_pages, config=decode_config, interpret=interpret,
        trace_capacity=trace_capacity, attention_sink=bool(sink), write_kv=write,
    )  # fmt: skip
    # Each kernel writes its sequences' tokens as the batch packs them, whatever q it reads.
    writes = (
        (jnp.take(new_kv, decode.rows, axis=0, mode="clip"), decode.tables()[2]) if write else ()
    )
    decode_outs = decode_call(*decode.tables(), q_decode, kv_pages, *sink, *writes)
    kv_pages = decode_outs[-1] if write else kv_pages
    layout = mixed_layout(tables[2], tables[3], config)
    q_mixed = jnp.take(q, layout.q_rows, axis=0, mode="clip")
    if interpret is False:  # compiled: in HBM, as q is (XLA would place a small gathered q in
        # VMEM itself, outside the kernel's scoped VMEM); jax 0.7.2 cannot interpret it
        q_mixed = pltpu.with_memory_space_constraint(q_mixed, pltpu.HBM)
    mixed_call = rpa_pallas_call(
        q_mixed, kv_pages, config=mixed_config, interpret=interpret,
        trace_capacity=trace_capacity, attention_sink=bool(sink), write_kv=write,
    )  # fmt: skip
    mixed_tables = (tables[0], tables[1], layout.cu_q_lens, tables[3])
    writes = (new_kv, tables[2]) if write else ()
    mixed_outs = mixed_call(*mixed_tables, q_mixed, kv_pages, *sink, *writes)
    kv_pages = mixed_outs[-1] if write else kv_pages
    out = jnp.take(mixed_outs[0], layout.out_rows, axis=0, mode="clip")
    # Rows of decode slots that hold no sequence point past the output: dropped.
    out = out.at[decode.rows].set(decode_outs[0], mode="drop")
    return out, kv_pages, (decode_outs[1], mixed_outs[1]) if trace_capacity else None


def rpa_pallas_call(
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]; shape and dtype
    kv_pages,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]; shape and dtype
    *,
    config: KernelConfig,
    interpret=False,
    trace_capacity: int = 0,
    copier_class: type[KVBlockCopier] | None = None,
    attention_sink: bool = False,
    write_kv: bool = False,
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

    `copier_class` (default `KVBlockCopier`) moves the KV blocks; the tests pass a subclass
    with a deliberate bug to show that their checks catch it.

    trace: i32[1 + trace_capacity, TRACE_FIELDS]; `trace[0, 0]` counts the events, which are
    rows 1.. of (kind, step heads block, step q block, heads block, seq, kv block, slot). The
    kernel records them through a wrapper (`tracing.with_trace`). The kernel body takes each
    ref by name (`plain.rpa_kernel`): the sinks as `sink_ref`, the trace as `trace_ref`.

    >>> from minilib.batch import make_batch
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
    viewed = dataclasses.replace(config, strided_kv_loads=can_load_kv_strided(config, interpret))
    c = dataclasses.replace(viewed, strided_fold=can_fold_q_strided(viewed, interpret))
    points = choose_points(c)
    num_q_blocks = pl.cdiv(max_num_batched_tokens, c.num_queries_per_block)
    q_block = (c.num_queries_per_block, c.num_q_heads_per_block, head_dim)

    def q_index_map(heads_blk, q_blk, *scalar_prefetch_refs):
        return (q_blk, heads_blk, 0)

    # Each ref of the kernel by the name `plain.rpa_kernel` takes it by, in pallas_call's order.
    inputs = {
        "q_ref": pl.BlockSpec(q_block, q_index_map),
        "kv_pages_hbm_ref": pl.BlockSpec(memory_space=pl.ANY),  # the kernel copies the pages
    }
    if attention_sink:
        sink_block = (c.num_kv_heads_per_block, c.num_q_heads_per_kv_head, LANES)
        inputs["sink_ref"] = pl.BlockSpec(sink_block, lambda heads_blk, *_: (heads_blk, 0, 0))
    o_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    outputs = {"o_ref": (pl.BlockSpec(q_block, q_index_map), o_shape)}
    if trace_capacity:
        trace_shape = jax.ShapeDtypeStruct((1 + trace_capacity, TRACE_FIELDS), jnp.int32)
        outputs["trace_ref"] = (pl.BlockSpec(memory_space=pltpu.SMEM), trace_shape)
    if write_kv:
        inputs["new_kv_hbm_ref"] = pl.BlockSpec(memory_space=pl.ANY)
        inputs["new_kv_cu_q_lens_ref"] = pl.BlockSpec(memory_space=pltpu.SMEM)
        cache_shape = jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype)
        outputs["kv_pages_out_ref"] = (pl.BlockSpec(memory_space=pl.ANY), cache_shape)
    rows = c.rows_per_kv_head
    scratch = {
        "kv_bufs": points.slot.scratch(c, kv_pages.dtype),  # two slots of one KV block each
        "sems": pltpu.SemaphoreType.DMA((2,)),  # one per slot
        "m_ref": pltpu.VMEM((c.num_kv_heads_per_block, rows, LANES), jnp.float32),
        "l_ref": pltpu.VMEM((c.num_kv_heads_per_block, rows, LANES), jnp.float32),
        "acc_ref": pltpu.VMEM((c.num_kv_heads_per_block, rows, head_dim), jnp.float32),
        "q_fold_ref": pltpu.VMEM((c.num_kv_heads_per_block, rows, head_dim), q.dtype),
        "slot_ref": pltpu.SMEM((1,), jnp.int32),
    }
    if write_kv:
        scratch["write_sem"] = pltpu.SemaphoreType.DMA((1,))
    names = [*TABLE_NAMES, *inputs, *outputs, *scratch]
    classes = dict(copier_class=copier_class or KVBlockCopier,
                   walker_class=walker_class(c))  # fmt: skip
    body = functools.partial(rpa_kernel, config=c, points=points)
    if trace_capacity:
        body = with_trace(body, trace_capacity, **classes)
    else:
        body = functools.partial(body, **classes)
    aliases = {}
    if write_kv:
        body = with_kv_write(body, c)
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


def sink_input(
    attention_sink: jax.Array,  # f32[num_q_heads]
    config: KernelConfig,
) -> jax.Array:  # f32[num_kv_heads, group, LANES]
    """The kernels' sink input: the sinks of each KV head's group of q heads, each repeated
    across the 128 lanes, as the kernel holds m and l.

    >>> sink_input(jnp.arange(4.0), kernel_config(jnp.zeros((1, 4, 128)),
    ...     jnp.zeros((1, 16, 4, 128)), jnp.zeros((1, 1), jnp.int32)))[:, :, 0].tolist()
    [[0.0, 1.0], [2.0, 3.0]]
    """
    group = config.num_q_heads_per_kv_head
    sinks = attention_sink.astype(jnp.float32).reshape(-1, group, 1)
    return jnp.broadcast_to(sinks, (*sinks.shape[:2], LANES))


@dataclasses.dataclass(frozen=True)
class MixedLayout:
    """The mixed kernel's q rows (`mixed_layout`)."""

    cu_q_lens: jax.Array  # i32[max_num_seqs + 1]: the sequences' rows in the mixed kernel's q
    q_rows: jax.Array  # i32[mixed rows]: the batch's q row each mixed row is gathered from
    out_rows: jax.Array  # i32[max_num_batched_tokens]: each batch row's mixed output row


def mixed_layout(cu_q_lens, num_seqs, config: KernelConfig) -> MixedLayout:
    """The mixed kernel's q: the rows of the sequences it serves, each starting on a q block
    while the padding fits.

    Packed as the batch packs them, a sequence starting mid-block costs one more (q block,
    sequence) pass, and each pass runs every KV block its rows see: 32 decode rows then a
    chunk of 256 rows take 3 + 3 q blocks of 128 where 2 + 2 would do. So here the decode and
    idle sequences take no rows (the decode kernel serves the one-token ones), and each other
    sequence's rows are padded to a multiple of `num_queries_per_block`, the padding BEFORE its
    rows: a row's position is kv_len - (q_end - row), so the real rows keep theirs, the
    padding rows get earlier ones (their q is any row's, their outputs are never read).

    The grid keeps the q blocks of the batch's q, so a sequence is padded only while its
    padding and that of all before it fit in the rows left free (the decode rows, the last
    block's rest), less the last row: no sequence owns it, so the kernel writes it zero, and
    the output rows no sequence owns are gathered from it (the decode rows too, before the
    decode kernel's rows are scattered over them). Later sequences are packed as they come.
    The tables must be clamped (`clamp_tables`).

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(3, 8), (1, 9), (5, 9), (2, 5)], max_num_batched_tokens=12)
    >>> config = kernel_config(b.q, b.kv_pages, b.page_indices, num_queries_per_block=4)
    >>> layout = mixed_layout(b.cu_q_lens, b.num_seqs, config)
    >>> b.cu_q_lens.tolist(), layout.cu_q_lens.tolist()  # 2 rows free: seq 0 padded, 2 not
    ([0, 3, 4, 9, 11], [0, 4, 4, 9, 11])
    >>> layout.q_rows.tolist()      # row 0: seq 0's padding (any row will do)
    [0, 0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11]
    >>> layout.out_rows.tolist()    # 11: the zero row (the decode row 3, the unused 11)
    [1, 2, 3, 11, 4, 5, 6, 7, 8, 9, 10, 11]
    """
    c = config
    bq, num_rows = c.num_queries_per_block, c.max_num_batched_tokens
    mixed_rows = pl.cdiv(num_rows, bq) * bq
    seq = jnp.arange(c.max_num_seqs, dtype=jnp.int32)
    live = seq < num_seqs[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    mixed = live & (q_lens > 1)
    rows = jnp.where(mixed, q_lens, 0)
    padding = jnp.where(mixed, -rows % bq, 0)
    spare = mixed_rows - jnp.sum(rows)
    rows = rows + jnp.where(jnp.cumsum(padding) < spare, padding, 0)
    mixed_cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(rows, dtype=jnp.int32)])
    # Row r of sequence s is row r + shift[s] of the mixed q: its rows end where its mixed end.
    shift = jnp.where(mixed, mixed_cu_q_lens[1:] - cu_q_lens[1:], 0)
    mixed_row = jnp.arange(mixed_rows, dtype=jnp.int32)
    mixed_shift = row_shifts(mixed_row, mixed_cu_q_lens, shift)
    row = jnp.arange(num_rows, dtype=jnp.int32)
    in_mixed = rows_in_seqs(row, cu_q_lens) & mixed  # bool[num_rows, max_num_seqs]
    row_shift = jnp.sum(jnp.where(in_mixed, shift, 0), axis=1)
    return MixedLayout(
        cu_q_lens=mixed_cu_q_lens,
        q_rows=jnp.clip(mixed_row - mixed_shift, 0, num_rows - 1),
        out_rows=jnp.where(jnp.any(in_mixed, axis=1), row + row_shift, mixed_rows - 1),
    )


def rows_in_seqs(rows, cu_q_lens):  # -> bool[len(rows), max_num_seqs]
    """Whether each row is one of each sequence's: a compare per (row, sequence), no gather."""
    return (cu_q_lens[:-1] <= rows[:, None]) & (rows[:, None] < cu_q_lens[1:])


def row_shifts(rows, cu_q_lens, shift):
    """shift[s] of the sequence s that owns each row (0 where none does)."""
    return jnp.sum(jnp.where(rows_in_seqs(rows, cu_q_lens), shift, 0), axis=1)


# The scalar-prefetched tables, by the names `plain.rpa_kernel` takes them by.
TABLE_NAMES = ("kv_lens_ref", "page_indices_ref", "cu_q_lens_ref", "num_seqs_ref")


def clamp_tables(kv_lens, page_indices, cu_q_lens, num_seqs, config: KernelConfig, total_num_pages):
    """The batch tables, clamped to what the shapes allow: run once, before the kernel.

    Under `jit` nothing has validated these values, and a bad one must not send a loop or a
    copy astray: a hang, or a copy from outside `kv_pages`. So each value is clamped, which
    changes nothing for a valid batch:
      num_seqs     to [0, max_num_seqs], and cut before the first sequence whose
                   cu_q_lens go backwards (`count_seqs_in_order`);
      cu_q_lens    to [0, max_num_batched_tokens];
      kv_lens      to [0, pages_per_seq * page_size];
      page numbers to [0, total_num_pages).
    Every loop over sequences in the kernel then ends by max_num_seqs, and every loop over
    pages or KV blocks by pages_per_seq (see also `plain.seq_kv_blocks`).

    Why here, not in the kernel: a few vector ops on small tables, once per call, in place of
    a clamp on every read of them in the kernel's loops.

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(3, 3), (1, 9)])
    >>> config = kernel_config(b.q, b.kv_pages, b.page_indices)
    >>> kv_lens, _, cu_q_lens, num_seqs = clamp_tables(
    ...     b.kv_lens.at[0].set(10**6), b.page_indices, b.cu_q_lens, b.num_seqs + 5, config,
    ...     total_num_pages=b.kv_pages.shape[0])
    >>> int(kv_lens[0]) == config.pages_per_seq * config.page_size, int(num_seqs[0])
    (True, 2)
    """
    c = config
    cu_q_lens = jnp.clip(cu_q_lens, 0, c.max_num_batched_tokens)
    return (
        jnp.clip(kv_lens, 0, c.pages_per_seq * c.page_size),
        jnp.clip(page_indices, 0, total_num_pages - 1),
        cu_q_lens,
        count_seqs_in_order(cu_q_lens, num_seqs, c)[None],
    )


def count_seqs_in_order(cu_q_lens, num_seqs, config: KernelConfig):
    """num_seqs clamped to [0, max_num_seqs], and cut before the first sequence whose
    cu_q_lens go backwards: the walk relies on the rows of sequence s + 1 following those of s.

    cu_q_lens: i32[max_num_seqs + 1]; num_seqs: i32[1]
    """
    n = jnp.clip(num_seqs[0], 0, config.max_num_seqs)
    seq = jnp.arange(config.max_num_seqs, dtype=jnp.int32)
    stops = (seq >= n) | (cu_q_lens[1:] < cu_q_lens[:-1])  # [max_num_seqs]
    return jnp.min(jnp.where(stops, seq, config.max_num_seqs)).astype(jnp.int32)

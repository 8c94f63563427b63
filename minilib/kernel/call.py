"""The entry point: `ragged_paged_attention` checks the inputs, decides the levers and builds the
`KernelConfig` (`kernel_config`); the jitted wrapper, `rpa_jit`, clamps the batch tables once
(`clamp_tables`) and runs the kernels (`run_kernels`). Without the decode kernel (as with
every lever off), one kernel on the batch as it is (`pallas_call.rpa_pallas_call`, whose body
is `plain.rpa_kernel`); with it, the decode kernel on the one-token sequences, then the mixed
kernel on the others, in a q of its own (`mixed_layout`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from minilib.block_sizes import (
    default_block_sizes,
    default_decode_seqs_per_block,
    default_vmem_limit,
    num_kv_heads_per_block,
)
from minilib.chips import current_chip
from minilib.errors import RPAInputError
from minilib.kernel.config import LANES, KernelConfig, Levers
from minilib.kernel.decode import decode_batch
from minilib.kernel.levers import (
    chosen_levers,
    decode_shape,
    levers_that_apply,
    split_configs,
    with_head_pipeline,
)
from minilib.kernel.mixed_layout import mixed_layout
from minilib.kernel.pallas_call import rpa_pallas_call
from minilib.kv_cache import combine_kv
from minilib.options import DEFAULT_MASK_VALUE, AttentionOptions, attention_options
from minilib.validation import check_new_kv, validate_inputs

__all__ = [
    "clamp_tables",
    "kernel_config",
    "ragged_paged_attention",
    "resolve_interpret",
    "rpa_jit",
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
    levers: Levers | None = None,
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

    `levers`: which speed levers to run with (`Levers`). None, the default: those chosen for
    the chip (`levers.chosen_levers`). `Levers.off()`: the plain algorithm, in one kernel, the
    production shape of the ladder's last rung. A lever that is on runs where it applies
    (`levers.levers_that_apply`); every choice gives the same answer, within rounding.

    Called eagerly, it checks the inputs' values first (`dynamic_validate_inputs`; not with
    `validate=False`); under `jax.jit` only the static checks run: validate outside, as JAX.

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(3, 3), (1, 9)])
    >>> ragged_paged_attention(*batch.args(), sm_scale=0.125).shape
    (4, 4, 64)
    >>> plain = ragged_paged_attention(*batch.args(), sm_scale=0.125, levers=Levers.off())
    >>> bool(jnp.allclose(plain, ragged_paged_attention(*batch.args(), sm_scale=0.125), atol=1e-5))
    True
    >>> new_k = new_v = jnp.ones((4, 2, 64), batch.q.dtype)       # written into the cache
    >>> out, kv_pages = ragged_paged_attention(*batch.args(), new_keys=new_k, new_values=new_v)
    >>> kv_pages[batch.page_indices[0, 0], :3, 0, 0].tolist()    # sequence 0's 3 tokens
    [1.0, 1.0, 1.0]
    """
    options = AttentionOptions(
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        mask_value=mask_value,
        k_scale=k_scale,
        v_scale=v_scale,
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block,
        vmem_limit_bytes=vmem_limit_bytes,
    )
    args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    validate_inputs(*args, options, validate=validate, attention_sink=attention_sink)
    interpret = resolve_interpret(interpret)
    config = kernel_config(q, kv_pages, page_indices, options, levers=levers, interpret=interpret)
    run = dict(config=config, interpret=interpret, trace_capacity=0)
    if new_keys is not None or new_values is not None:
        check_new_kv(new_keys, new_values, q, kv_pages)
        out, kv_pages, _ = rpa_write_jit(*args, new_keys, new_values, attention_sink, **run)
        return out, kv_pages
    out, _ = rpa_jit(*args, attention_sink, **run)
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
    *,
    levers: Levers | None = None,
    interpret=None,
    **option_values,
) -> KernelConfig:
    """Choose the heads blocks, fill in default block sizes, and decide the levers: those
    asked for (`levers`; None: `chosen_levers` for the chip) that apply to each kernel run
    with `interpret` as the pallas_call's (`levers_that_apply`: False compiled, True plain
    interpret mode, a `pltpu.InterpretParams` TPU interpret mode; None: as
    `resolve_interpret(None)` turns it), kept in `levers` and `decode_levers`. Inputs must be
    validated.

    The options come as one `AttentionOptions`, or as keywords (`num_queries_per_block=8`).

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(5, 20)], num_q_heads=8, num_kv_heads=2, page_size=16)
    >>> config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, sliding_window=64)
    >>> config.sliding_window, config.num_heads_blocks * config.num_kv_heads_per_block
    (64, 2)
    >>> config.levers.open_blocks, config.decode_levers.open_blocks   # a window: no open block
    (False, False)
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
    )
    if interpret is None:
        interpret = resolve_interpret(None)
    return with_levers(config, levers, interpret)


def with_levers(config: KernelConfig, asked: Levers | None, interpret) -> KernelConfig:
    """`config` with its levers decided, and the decode kernel's beside them: the levers of
    `asked` (None: `chosen_levers` for the chip, for each kernel) that apply to each."""
    if asked is not None and not isinstance(asked, Levers):
        raise RPAInputError(
            f"levers={asked!r} is not a Levers",
            "pass None (the levers chosen for the chip), Levers.off() (the plain kernel), or "
            "a Levers with the levers you want on, e.g. Levers.only('fixed_max')",
        )
    chip = current_chip()
    asked_here = asked or chosen_levers(chip, head_dim=config.head_dim)
    levers = levers_that_apply(config, asked_here, interpret)
    decode_levers = None
    if levers.decode_kernel:
        asked_decode = asked or chosen_levers(chip, head_dim=config.head_dim, decode_kernel=True)
        decode_levers = levers_that_apply(decode_shape(config), asked_decode, interpret)
    decided = dataclasses.replace(config, levers=levers, decode_levers=decode_levers)
    return with_head_pipeline(decided)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "trace_capacity"))
def rpa_jit(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    attention_sink=None,
    *,
    config,
    interpret,
    trace_capacity,
):
    """The kernels on one batch (`run_kernels`). Returns (out, None), or with
    `trace_capacity > 0` (out, (decode trace or None, mixed trace)).

    The batch tables are clamped here, once (`clamp_tables`): under `jit` nothing has
    validated them, and the kernels read them as they are.

    `attention_sink` (f32[num_q_heads] or None) goes to the kernels as `sink_input` makes it.

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(3, 3), (1, 9)])
    >>> config = kernel_config(batch.q, batch.kv_pages, batch.page_indices)
    >>> out, traces = rpa_jit(*batch.args(), config=config, interpret=resolve_interpret(True),
    ...                       trace_capacity=0)
    >>> out.shape == batch.q.shape, traces
    (True, None)
    """
    tables = (kv_lens, page_indices, cu_q_lens, num_seqs)
    run = dict(config=config, interpret=interpret, trace_capacity=trace_capacity)
    out, _, traces = run_kernels(q, kv_pages, tables, attention_sink, None, **run)
    return out, traces


@functools.partial(
    jax.jit, static_argnames=("config", "interpret", "trace_capacity"), donate_argnames="kv_pages"
)
def rpa_write_jit(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    new_keys,
    new_values,
    attention_sink=None,
    *,
    config,
    interpret,
    trace_capacity,
):
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
    tables = (kv_lens, page_indices, cu_q_lens, num_seqs)
    run = dict(config=config, interpret=interpret, trace_capacity=trace_capacity)
    return run_kernels(q, kv_pages, tables, attention_sink, new_kv, **run)


def run_kernels(q, kv_pages, tables, attention_sink, new_kv, *, config, interpret, trace_capacity):
    """The body of `rpa_jit` and `rpa_write_jit`: (out, kv_pages, traces); without `new_kv`
    ([max_num_batched_tokens, 2*num_kv_heads, head_dim] or None) the cache is returned as
    given.

    Without the decode kernel (as with every lever off), one kernel on the batch as it is.
    With the decode kernel (`Levers.decode_kernel`), that one first, on the one-token
    sequences gathered into a batch of their own (`decode_batch`); then the mixed kernel on the
    others, in a q of its own (`mixed_layout`); the output gathered back from the mixed
    kernel's, the decode rows scattered into it. Each kernel writes its sequences' new tokens."""
    tables = clamp_tables(*tables, config, total_num_pages=kv_pages.shape[0])
    mixed_config, decode_config = split_configs(config)
    sink = () if attention_sink is None else (sink_input(attention_sink, config),)
    kernel = dict(interpret=interpret, trace_capacity=trace_capacity, attention_sink=bool(sink))
    write = new_kv is not None
    if decode_config is None:
        call = rpa_pallas_call(q, kv_pages, config=mixed_config, write_kv=write, **kernel)
        writes = (new_kv, tables[2]) if write else ()
        outs = call(*tables, q, kv_pages, *sink, *writes)
        kv_pages = outs[-1] if write else kv_pages
        return outs[0], kv_pages, (None, outs[1]) if trace_capacity else None
    decode = decode_batch(*tables, config)
    q_decode = jnp.take(q, decode.rows, axis=0, mode="clip")  # [max_num_seqs, heads, hd]
    decode_call = rpa_pallas_call(
        q_decode, kv_pages, config=decode_config, write_kv=write, **kernel
    )
    # Each kernel writes its sequences' tokens as the batch packs them, whatever q it reads.
    writes = ()
    if write:
        writes = (jnp.take(new_kv, decode.rows, axis=0, mode="clip"), decode.tables()[2])
    decode_outs = decode_call(*decode.tables(), q_decode, kv_pages, *sink, *writes)
    kv_pages = decode_outs[-1] if write else kv_pages
    layout = mixed_layout(tables[2], tables[3], config)
    q_mixed = jnp.take(q, layout.q_rows, axis=0, mode="clip")
    if interpret is False:  # compiled: in HBM, as q is (XLA would place a small gathered q in
        # VMEM itself, outside the kernel's scoped VMEM); jax 0.7.2 cannot interpret it
        q_mixed = pltpu.with_memory_space_constraint(q_mixed, pltpu.HBM)
    mixed_call = rpa_pallas_call(q_mixed, kv_pages, config=mixed_config, write_kv=write, **kernel)
    mixed_tables = (tables[0], tables[1], layout.cu_q_lens, tables[3])
    writes = (new_kv, tables[2]) if write else ()
    mixed_outs = mixed_call(*mixed_tables, q_mixed, kv_pages, *sink, *writes)
    kv_pages = mixed_outs[-1] if write else kv_pages
    out = jnp.take(mixed_outs[0], layout.out_rows, axis=0, mode="clip")
    # Rows of decode slots that hold no sequence point past the output: dropped.
    out = out.at[decode.rows].set(decode_outs[0], mode="drop")
    return out, kv_pages, (decode_outs[1], mixed_outs[1]) if trace_capacity else None


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
    pages or KV blocks by pages_per_seq (see also `walk.seq_kv_blocks`).

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

"""What attention sinks cost our kernel, as the TPU compiler sees it: static estimates from the
compiled programs, not timings.

`python -m minilib compile --sinks` compiles our kernel with attention sinks (`attention_sink`,
an f32[num_q_heads] argument of the program, `rpa_with_sink`) in the comparison of
`minilib.tpu.kernel_costs`; JAX's kernel and v3's head_dim-128 kernel have no sinks, and are
left out. The sinks join the softmax denominator once per output row
(`minilib.kernel.plain.OnlineSoftmax.sink_term`), after the KV-block loops: those issue the
same vector, MXU, memory and DMA ops with sinks as without, and no more bundles but for the
scheduler's placing, a few bundles either way (libtpu 0.0.50.1, page copies with bounds
checks: decode v5e 482 -> 481, v6e 606 -> 607, TPU7x 8 q 770 -> 771; without them, v6e 8 q
619 -> 616, with the very same ops; `tests/tpu/test_tpu_compile.py` checks it on v5e, v6e and
TPU7x). What they add is outside
the loops, once per q block (mixed kernel) or per sequence (decode kernel): with libtpu
0.0.50.1, on the comparison workload, 42 to 140 bundles of the whole kernel (v5e, before the
decode kernel's padded slot: 32 q per block 3436 -> 3576, 8 q 1641 -> 1683, decode 1022 ->
1065), the same VMEM and spills.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from minilib.tpu.compile import CompileReport, compile_for_tpu

__all__ = ["compile_with_sinks", "rpa_with_sink"]


def rpa_with_sink(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, attention_sink,
                  **options):  # fmt: skip
    """minilib's kernel, compiled unless `interpret` says otherwise, with its attention sinks
    (f32[num_q_heads]) an argument of the program, as in a model, not a constant folded in.

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(2, 5)])
    >>> rpa_with_sink(*b.args(), jnp.zeros(4, jnp.float32), interpret=True).shape
    (2, 4, 64)
    """
    from minilib.kernel import ragged_paged_attention

    options.setdefault("interpret", False)
    return ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                  attention_sink=attention_sink, **options)  # fmt: skip


def compile_with_sinks(specs, *, chip: str = "v5e", **options) -> CompileReport:
    """Compile our kernel with attention sinks for `chip` (`kernel_costs.compile_rpa`, with an
    f32[num_q_heads] sink argument after the six of `rpa_specs`); options as for the kernel.

    Needs libtpu (not a TPU): the example compiles only where libtpu is installed.

    >>> from minilib.tpu.compile import tpu_compile_available
    >>> from minilib.tpu.kernel_costs import rpa_specs
    >>> specs = rpa_specs(num_q_heads=4, num_kv_heads=2, pages_per_seq=8, max_num_seqs=4,
    ...                   max_num_batched_tokens=64)
    >>> ok, _ = tpu_compile_available()
    >>> report = compile_with_sinks(specs, chip="v5e", num_kv_pages_per_block=4,
    ...                             num_queries_per_block=16) if ok else None  # needs libtpu
    >>> report is None or report.bundles_per_kv_block > 0
    True
    """
    options.setdefault("sm_scale", specs[0].shape[-1] ** -0.5)
    sink = jax.ShapeDtypeStruct((specs[0].shape[1],), jnp.float32)  # [num_q_heads]
    return compile_for_tpu(functools.partial(rpa_with_sink, **options), *specs, sink, chip=chip)

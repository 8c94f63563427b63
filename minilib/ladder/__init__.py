"""The kernel ladder: the Pallas kernels a learner writes in notebooks 07 and 08, one idea each.

Each module is the tested version of one rung, imported by the notebooks after the learner has
written it:

  `flash`            rung 1: flash attention over dense K/V; an "arbitrary" KV grid axis, the
                     online softmax state in VMEM scratch, `pl.when` to initialise and finish.
  `scalar_prefetch`  rung 2: paged decode attention; the index map reads `page_indices` from
                     SMEM, and Pallas copies the pages (double-buffered for us). Also the
                     decode `pallas_call` (`decode_pallas_call`) that rungs 3 to 5 reuse with
                     their own grid, scratch and `kv_pages` spec.
  `async_copy`       rung 3: the same with `kv_pages` left in HBM (`pl.ANY`): one buffer, one
                     `make_async_copy`, `start()` then `wait()`.
  `double_buffer`    rung 4: two slots and two semaphores: copy page i + 1 while computing page i.
  `prefetch`         rung 5: prefetching across grid steps: `next_work`, in Python and in the
                     kernel.
  `prefill_chunk`    rung 6: a prefill chunk, q blocks against KV blocks of several pages (one
                     copy a page, one wait a block), the blocks past the diagonal skipped.
  `ragged`           rung 7: the ragged batch with JAX's signature: a q block's sequences
                     walked, the next copy chosen across sequence and q-block boundaries; the
                     step from these rungs to `minilib.kernel`, whose `Levers.off()` is its
                     production shape.
  `aligned_blocks`   not a rung: notebook 07's first attention kernel (`pallas_basics`) with
                     whole head blocks, so that Mosaic compiles it; no checker.
  `interpret`        the strict TPU interpret mode the checkers run them in, and the race
                     detector's verdict.
  `watch`            the ledger of a kernel's copies and waits in that mode, with which the
                     checkers name a DMA bug (a deadlock the moment it happens, a copy never
                     waited for, two slots on one semaphore, a slot overwritten).

Each rung's `__all__` names what runs outside a kernel: the `pallas_call` wrapper, its
reference, the Python plans. The kernel bodies (`*_kernel`) and their inner steps
(`init_online_softmax`, `attend_kv_block`, `write_output`, `page_index_map`, ...) run only
inside a Pallas kernel; their docstrings and comments document them, and the wrappers' examples
run them.
"""

__all__: list[str] = []  # the rungs are modules: `from minilib.ladder.flash import ...`

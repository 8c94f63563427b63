"""Static TPU analysis, without a TPU: each chip's memories, a real compile with libtpu, and
our kernel against JAX's and vLLM's RPA v3, compiled. Everything it reports is a static
estimate read from the compiled program, never a timing. The chips' published figures are
`minilib.chips`; the patches to jax that minilib applies when imported, `minilib.jax_patches`.

  memory.py        HBM, VMEM, SMEM, vector registers and MXUs per chip (no libtpu needed)
  compile.py       compile a kernel for a chip with libtpu; bundles, VMEM, spills
  bundles.py       a compiled kernel's listing: bundles, loops, the counting rule
  loop_paths.py    paths through one KV block's loop, following its branches
  dump_reader.py   what libtpu wrote down: per kernel, its loop, paths, ops, VMEM
  v3.py            vLLM's RPA v3 kernel, loaded from its published wheel
  kernel_costs.py  ours against JAX's and v3, compiled, per chip and config
  lever_costs.py   what each speed lever buys, from Levers.off() to every lever, compiled
  block_times.py   a KV block's bundles and bytes as time, per chip (static)
  comparison.py    what we claim from it, its recorded figures, `python -m minilib compile`
  recorded.py      the notebooks' compile results, recorded for where nothing compiles
  sinks.py         ours with attention sinks, compiled (`python -m minilib compile --sinks`)
  numerics.py      a TPU's float32 matmuls (one bfloat16 pass) emulated on the CPU
"""

__all__: list[str] = []  # import from the modules: `from minilib.tpu.compile import ...`

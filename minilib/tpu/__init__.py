"""Static TPU analysis, without a TPU: each chip's memories, a real compile with libtpu, and
our kernel against JAX's, compiled. Everything it reports is a static estimate read from the
compiled program, never a timing.

  memory.py        HBM, VMEM, SMEM, vector registers and MXUs per chip (no libtpu needed)
  compile.py       compile a kernel for a chip with libtpu; bundles, VMEM, spills
  kernel_costs.py  `python -m minilib compile`: our kernel against JAX's
"""

__all__: list[str] = []  # import from the modules: `from minilib.tpu.compile import ...`

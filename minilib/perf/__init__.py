"""Measuring: honest timings, the serving workloads they run on, the roofline that bounds them,
and `python -m minilib bench`, which puts every implementation in one table.

  timing.py     time a JAX function honestly: compiles apart, warm calls apart
  workloads.py  decode-heavy, mixed and prefill-heavy serving steps within a token budget
  roofline.py   the bytes and FLOPs a batch cannot avoid, against each chip's peak
  implementations.py  the implementations the benchmark times, and how each runs here
  bench.py      `python -m minilib bench`: every implementation on the same batches
  memory_sweep.py  compiled working memory of each implementation as max_kv_len grows
  plots.py      the benchmark's plots: its times, and working memory against max_kv_len
  tpu_bench.py  `python -m minilib bench --tpu`: ours, JAX's and v3 on the workload suite, on a TPU
"""

__all__: list[str] = []  # import from the modules: `from minilib.perf.bench import ...`

"""The course's speed targets, PASS/FAIL, all ratios measured in this one run.

    JAX_PLATFORMS=cpu python benchmarks/check_targets.py   # = python -m minilib bench --targets

The case: a 32-sequence mixed step (about half decodes) of a GQA model, 32 q heads, 8 KV heads,
head_dim 128, page_size 16, pages_per_seq 64 (kv lengths 1 to 1024), max_num_batched_tokens
1024, float32 on CPU (bfloat16 on a TPU). See `minilib.bench.check_targets` for the targets.
Exit code 0 when every target passes, 1 otherwise.
"""

from __future__ import annotations

import sys

from minilib.bench import main

if __name__ == "__main__":
    sys.exit(main(["--targets", *sys.argv[1:]]))

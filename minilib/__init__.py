"""minilib: the library behind the ragged paged attention course.

Each notebook builds one idea; from then on the course imports the tested version from here.
The modules at the top are what the course builds, chapter by chapter; the tools it uses live
in `minilib.explore`, `minilib.tpu` and `minilib.perf` (minilib/README.md has the map).

>>> from minilib import tpu_compile
Traceback (most recent call last):
...
ModuleNotFoundError: minilib.tpu_compile moved: compiling is minilib.tpu.compile, ...
"""

import importlib.abc
import sys

from minilib import jax_patches
from minilib.batch import RaggedBatch, make_batch, random_seq_lens, seq_kind
from minilib.block_sizes import default_block_sizes
from minilib.blockwise import ragged_paged_attention_blockwise
from minilib.errors import KVCacheError, RPAInputError
from minilib.heads import (
    attention_kind,
    check_head_counts,
    combined_head_slots,
    head_groups,
    kv_head_for_q_head,
    merge_kv_pages,
    nearest_valid_num_kv_heads,
    repeat_kv,
    split_kv_pages,
    valid_num_kv_heads,
)
from minilib.kernel import ragged_paged_attention
from minilib.kv_cache import (
    PageAllocator,
    PagedKVCache,
    bucket_size,
    pages_needed,
    write_tokens,
)
from minilib.options import DEFAULT_MASK_VALUE, AttentionOptions
from minilib.pallas_basics import add_vectors, ragged_paged_attention_pallas_basic
from minilib.reference import ref_ragged_paged_attention
from minilib.schedule import Schedule, plan_schedule, record_schedule
from minilib.tpu import numerics
from minilib.validation import (
    dynamic_validate_inputs,
    static_validate_inputs,
    validate_inputs,
)
from minilib.vectorized import ragged_paged_attention_jnp

# Where the installed jax and libtpu need it, patch jax (minilib.jax_patches): lower kernels at
# the Mosaic IR version libtpu reads (Colab's jax 0.7.2 with libtpu 0.0.21.1), and jax 0.7's
# scalar constants in linear time. Nothing changes elsewhere. Importing any minilib module
# runs this.
jax_patches.apply()
# MINILIB_TPU_NUMERICS=1: float32 matmuls at the default precision run as on a TPU, one
# bfloat16 pass (minilib.tpu.numerics), for the whole process.
numerics.apply_from_environment()

__all__ = [
    "AttentionOptions",
    "DEFAULT_MASK_VALUE",
    "KVCacheError",
    "PageAllocator",
    "PagedKVCache",
    "bucket_size",
    "pages_needed",
    "write_tokens",
    "RPAInputError",
    "RaggedBatch",
    "add_vectors",
    "attention_kind",
    "check_head_counts",
    "combined_head_slots",
    "dynamic_validate_inputs",
    "head_groups",
    "kv_head_for_q_head",
    "make_batch",
    "merge_kv_pages",
    "nearest_valid_num_kv_heads",
    "Schedule",
    "default_block_sizes",
    "plan_schedule",
    "ragged_paged_attention",
    "ragged_paged_attention_blockwise",
    "ragged_paged_attention_pallas_basic",
    "random_seq_lens",
    "record_schedule",
    "ragged_paged_attention_jnp",
    "ref_ragged_paged_attention",
    "repeat_kv",
    "seq_kind",
    "split_kv_pages",
    "static_validate_inputs",
    "valid_num_kv_heads",
    "validate_inputs",
]


# Modules that moved into the tool packages, and where to import from now. An old path
# raises an error that says so, rather than "No module named ...".
MOVED = {
    "viz": "each figure is in the minilib.explore module of its idea (head_grouping, "
    "page_table, ragged_batch, kernel_schedule); the benchmark plots are in minilib.perf.plots",
    "widgets": "each explorer is in the minilib.explore module of its idea (head_grouping, "
    "page_table, ragged_batch, kernel_schedule, playground)",
    "mistakes": "it is minilib.explore.mistakes",
    "tpu_compile": "compiling is minilib.tpu.compile, reading the dump minilib.tpu.dump_reader",
    "tpu_memory": "it is minilib.tpu.memory",
    "kernel_costs": "it is minilib.tpu.kernel_costs",
    "timing": "it is minilib.perf.timing",
    "workloads": "it is minilib.perf.workloads",
    "roofline": "it is minilib.perf.roofline",
    "bench": "it is minilib.perf.bench",
    "tpu.chips": "the chips' facts are minilib.chips",
    "tpu.mosaic_version": "it is minilib.jax_patches.mosaic_version",
    "tpu.literal_keys": "it is minilib.jax_patches.literal_keys",
}


def _moved(name: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(f"minilib.{name} moved: {MOVED[name]}. Import from there.")


class _MovedModules(importlib.abc.MetaPathFinder):
    """Asked last, for a `minilib.` module no other finder found (`import minilib.viz`)."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package == "minilib" and name in MOVED:
            raise _moved(name)
        return None


sys.meta_path.append(_MovedModules())


def __getattr__(name: str):
    """`from minilib import viz`: Python asks the package for the name after the finder."""
    if name in MOVED:
        raise _moved(name)
    raise AttributeError(f"module 'minilib' has no attribute {name!r}")

"""The kernels writing the new tokens' K/V into the cache (`new_keys`, `new_values`) compile for
the chips of Colab's TPU runtimes, on the newest stack and on Colab's pair (jax 0.7.2 with
libtpu 0.0.21.1), and the compiled program makes no copy of the cache: with `kv_pages`
donated, each kernel writes into the very buffer it was given, and the program returns it.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from compile_checks import TPU_COMPILE, require_chip

from minilib.kernel import ragged_paged_attention
from minilib.tpu.at_defaults import compile_call
from minilib.tpu.kernel_costs import COMPARISON_CASE, rpa_specs

pytestmark = TPU_COMPILE

CHIPS = ("v5e", "v6e")  # Colab's
KV_DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}


def writing_call(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, new_keys, new_values):
    out, kv_pages = ragged_paged_attention(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, new_keys=new_keys,
        new_values=new_values, sm_scale=0.1, interpret=False,
    )  # fmt: skip
    return out, kv_pages


def writing_specs(kv_dtype):
    """The comparison's case (an 8192-page cache), and the new K and V of every q row."""
    specs = rpa_specs(**COMPARISON_CASE, kv_dtype=kv_dtype)
    q, kv_pages = specs[:2]
    new = jax.ShapeDtypeStruct((q.shape[0], kv_pages.shape[2] // 2, q.shape[2]), q.dtype)
    return (*specs, new, new)


def compiled(specs, chip: str, donate_argnums) -> tuple[str, list]:
    """The writing call on `specs`, compiled for `chip` with `donate_argnums` donated: its
    HLO text, and its Pallas kernels' programs (bundles read from this compile's dump)."""
    text, programs = compile_call(writing_call, specs, chip, donate_argnums)
    return text, [p for p in programs if p.kernel]


@functools.cache
def cache_program(chip: str, kv_dtype: str) -> tuple[str, list]:
    """The writing call compiled with the cache donated: (its HLO, its kernels)."""
    return compiled(writing_specs(KV_DTYPES[kv_dtype]), chip, (1,))


@pytest.mark.parametrize("chip", CHIPS)
def test_kv_write_kernels_compile(chip):
    """Both kernels, decode and mixed, each with its bundle dump (static estimates): the
    program the no-copy test below reads."""
    require_chip(chip)
    _, kernels = cache_program(chip, "bf16")  # named by jax (jax 0.7.2: after the function)
    assert len(kernels) == 2 and all(k.bundles for k in kernels), [k.name for k in kernels]


# Each chip with a bf16 cache; an fp8 cache (its new K/V cast by XLA first) on the first.
NO_COPY_CASES = [(chip, "bf16") for chip in CHIPS] + [(CHIPS[0], "fp8")]


@pytest.mark.parametrize("chip, kv_dtype", NO_COPY_CASES)
def test_kv_write_makes_no_copy_of_the_cache(chip, kv_dtype):
    """No copy (and no copy-start) of an array shaped as the cache; the program's output 1,
    the cache, aliases its parameter 1, and each kernel's output 1 its cache operand."""
    require_chip(chip)
    text, _ = cache_program(chip, kv_dtype)
    cache = writing_specs(KV_DTYPES[kv_dtype])[1]
    shape = ",".join(map(str, cache.shape))
    copies = re.findall(rf"\[{shape}\][^ ]* copy(?:-start)?\(", text)
    assert not copies, f"the compiled program copies the cache: {copies}"
    assert re.search(r"input_output_alias=\{ \{1\}: \(1, ", text), "the cache is not aliased"
    kernels = re.findall(r"output_to_operand_aliasing=\{\{1\}: \(5, ", text)
    assert len(kernels) == 2, "each kernel's output 1 should alias operand 5, the cache"


def test_the_no_copy_check_can_fail():
    """Not donated, the entry's cache must be copied before a kernel writes it: the check
    above sees that copy."""
    chip = CHIPS[0]
    require_chip(chip)
    specs = writing_specs(jnp.bfloat16)
    text, _ = compiled(specs, chip, ())
    shape = ",".join(map(str, specs[1].shape))
    assert re.findall(rf"\[{shape}\][^ ]* copy(?:-start)?\(", text)

"""Plausible wrong answers to the kernel ladder's exercises, as a learner writes them.

Each `WrongAnswer` names its rung, the checker, how to build the learner's function, and words
its report must contain (the named cause). `tests/exercises/test_ladder_checkers.py` runs them
all in .venv, and on the other stacks those marked `fast=True`: one per rung, and two whose
cause is found another way where the interpreter lets a negative SMEM index wrap around (jax
before 0.12.1, as .venv-oldest's 0.7.2) than where it stops on it (.venv's).

The kernels start from the solutions (solutions/ex07_flash.py, ex08_ladder.py) and change one
thing, the `variant`; each variant is commented with the mistake it makes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import textwrap
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from ladder_wrong_walks import (
    next_work_variant,
    rung5,
    rung5_no_prefetch_across_steps,
    rung6,
    rung7,
)

import minilib.exercises as ex
from minilib.ladder import (
    async_copy,
    double_buffer,
    flash,
    prefill_chunk,
    ragged,
    scalar_prefetch,
)
from minilib.ladder.flash import init_online_softmax
from minilib.ladder.scalar_prefetch import attend_kv_block, write_output

MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class WrongAnswer:
    rung: str
    name: str
    checker: Callable
    make: Callable[[], Callable]
    expect: tuple[str, ...]  # words the report must contain
    fast: bool = False


# --- rung 1a: the flash kernel body ----------------------------------------------------------


def flash_body(variant: str) -> Callable:
    def kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, kv_len, q_len, sm_scale):
        i, j = pl.program_id(1), pl.program_id(2)
        block_q, block_kv = q_ref.shape[0], k_ref.shape[0]

        init = j == 0
        if variant == "init_every_step":  # resets m, l, acc on every KV block
            init = j >= 0

        @pl.when(init)
        def _init():
            if variant == "no_init":  # forgets to initialise: scratch starts as NaN
                return
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        row = jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        q_pos = {
            "no_kv_offset": i * block_q + row,  # forgets kv_len - q_len
            "no_block_offset": kv_len - q_len + row,  # forgets i * block_q
        }.get(variant, kv_len - q_len + i * block_q + row)
        k_pos = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        q, k = q_ref[...].astype(jnp.float32), k_ref[...].astype(jnp.float32)
        v = v_ref[...].astype(jnp.float32)
        if variant != "v_not_zeroed":  # masks the scores, but 0 * NaN = NaN in p @ v
            v = jnp.where(k_pos.T < kv_len, v, 0.0)
        s = jnp.dot(q, k.T)
        if variant == "head_dim_scale":  # 1/sqrt(head_dim), not the sm_scale it is given
            sm_scale = q.shape[-1] ** -0.5
        if variant != "no_sm_scale":
            s = s * sm_scale
        visible = (k_pos <= q_pos) & (k_pos < kv_len)
        if variant == "no_causal_mask":
            visible = k_pos < kv_len
        if variant == "diagonal_hidden":  # `<` where `<=` is due: each row hides its own key
            visible = (k_pos < q_pos) & (k_pos < kv_len)
        if variant == "one_future_key":  # one past the diagonal: each row sees the next key too
            visible = (k_pos <= q_pos + 1) & (k_pos < kv_len)
        s_max = s.max(axis=1, keepdims=True)  # before the mask: used by "max_before_mask"
        if variant == "mask_added":  # a bias, as JAX's reference: NaN + mask is still NaN
            s = s + jnp.where(visible, 0.0, MASK)
        else:
            s = jnp.where(visible, s, MASK)
        if variant != "max_before_mask":  # takes the max over the keys past kv_len too
            s_max = s.max(axis=1, keepdims=True)
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, s_max)
        p = jnp.exp(s - m_next)
        alpha = jnp.exp(m_prev - m_next)
        if variant == "no_rescale":  # forgets alpha
            alpha = jnp.ones_like(alpha)
        if variant == "alpha_sign":  # alpha upside down: exp(-inf) on the first block is inf
            alpha = jnp.exp(m_next - m_prev)
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v)
        m_ref[...] = m_next

        last = j == pl.num_programs(2) - 1
        if variant == "write_first":  # writes acc / l after the first KV block
            last = j == 0
        if variant == "write_never":  # one past the last KV block: the output is never written
            last = j == pl.num_programs(2)

        @pl.when(last)
        def _finish():
            o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)

    return functools.partial(flash.flash_attention, kernel=kernel)


# --- rung 1b: the flash pallas_call ------------------------------------------------------------


def flash_call(variant: str) -> Callable:
    def fn(q, k, v, *, kv_len, sm_scale, block_q=8, block_kv=8, interpret=False,
           kernel=flash.flash_kernel):  # fmt: skip
        num_heads, q_len, head_dim = q.shape
        num_kv_blocks = pl.cdiv(kv_len, block_kv)
        if variant == "grid_to_max_kv_len":  # walks the NaN blocks past kv_len too
            num_kv_blocks = k.shape[1] // block_kv
        grid = (num_heads, q_len // block_q, num_kv_blocks)
        if variant == "grid_swapped":  # the KV blocks on axis 1, the q blocks on axis 2
            grid = (num_heads, num_kv_blocks, q_len // block_q)
        q_map = lambda h, i, j: (h, i, 0)
        kv_map = {
            "kv_map_uses_i": lambda h, i, j: (h, i, 0),  # the q block's index for K and V
            "kv_map_offsets": lambda h, i, j: (h, j * block_kv, 0),  # an element offset
            "kv_map_ignores_j": lambda h, i, j: (h, 0, 0),  # always the first KV block
        }.get(variant, lambda h, i, j: (h, j, 0))
        out_map = (lambda h, i, j: (h, j, 0)) if variant == "out_map_uses_j" else q_map
        semantics = {
            "all_parallel": ("parallel", "parallel", "parallel"),  # the KV axis carries state
            "all_arbitrary": ("arbitrary", "arbitrary", "arbitrary"),
        }.get(variant, ("parallel", "parallel", "arbitrary"))
        acc = pltpu.VMEM((block_q, head_dim), jnp.float32)
        if variant == "acc_bf16":  # the running sum in bf16
            acc = pltpu.VMEM((block_q, head_dim), jnp.bfloat16)
        stat = (block_q, head_dim) if variant == "m_l_full_width" else (block_q, 1)
        if variant == "ignores_kernel":  # the library's body, whatever `kernel` it is given
            kernel = flash.flash_kernel
        if variant == "interpret_true":  # interpret mode hard-coded: never compiled for a TPU
            interpret = True
        return pl.pallas_call(
            functools.partial(kernel, kv_len=kv_len, q_len=q_len, sm_scale=sm_scale),
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            grid=grid,
            in_specs=[
                pl.BlockSpec((None, block_q, head_dim), q_map),
                pl.BlockSpec((None, block_kv, head_dim), kv_map),
                pl.BlockSpec((None, block_kv, head_dim), kv_map),
            ],
            out_specs=pl.BlockSpec((None, block_q, head_dim), out_map),
            scratch_shapes=[pltpu.VMEM(stat, jnp.float32), pltpu.VMEM(stat, jnp.float32), acc],
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
            interpret=interpret,
        )(q, k, v)

    return fn


# --- rung 2: scalar prefetch ---------------------------------------------------------------------


def rung2(variant: str) -> Callable:
    def index_map(seq, i, kv_lens_ref, page_indices_ref, *, page_size):
        num_pages = pl.cdiv(kv_lens_ref[seq], page_size)
        if variant == "no_clamp":  # reads the garbage entries past the last page
            return (page_indices_ref[seq, i], 0, 0, 0)
        if variant == "clamp_off_by_one":  # min(i, num_pages): one past the last page
            return (page_indices_ref[seq, jnp.minimum(i, num_pages)], 0, 0, 0)
        if variant == "page_by_position":  # page i of the pool, not of the sequence
            return (jnp.minimum(i, num_pages), 0, 0, 0)
        if variant == "kv_len_of_page_axis":  # kv_lens_ref[i]: i is the page, not the sequence
            num_pages = pl.cdiv(kv_lens_ref[i], page_size)
        if variant == "clamp_to_minus_one":  # kv_len 0: num_pages - 1 = -1, read before the row
            page = page_indices_ref[seq, jnp.minimum(i, num_pages - 1)]
            return (jnp.where(num_pages > 0, page, 0), 0, 0, 0)
        if variant == "clamp_to_minus_one_unguarded":  # kv_len 0 reads page_indices[seq, -1]
            return (page_indices_ref[seq, jnp.minimum(i, num_pages - 1)], 0, 0, 0)
        page = page_indices_ref[seq, jnp.minimum(i, jnp.maximum(num_pages - 1, 0))]
        if variant == "empty_slot_reads_its_row":  # kv_len 0: its whole row is garbage
            return (page, 0, 0, 0)
        if variant == "element_offset":  # the page's first token, not its block index
            return (jnp.where(num_pages > 0, page, 0) * page_size, 0, 0, 0)
        return (jnp.where(num_pages > 0, page, 0), 0, 0, 0)

    def kernel(kv_lens_ref, page_indices_ref, q_ref, page_ref, o_ref, m_ref, l_ref, acc_ref, *,
               sm_scale):  # fmt: skip
        seq, i = pl.program_id(0), pl.program_id(1)
        kv_len, page_size = kv_lens_ref[seq], page_ref.shape[0]

        @pl.when((i >= 0) if variant == "init_every_page" else (i == 0))
        def _init():
            init_online_softmax(m_ref, l_ref, acc_ref)

        first_pos = 0 if variant == "positions_from_zero" else i * page_size
        if variant == "head_dim_scale":  # 1/sqrt(head_dim), not the sm_scale it is given
            sm_scale = q_ref.shape[-1] ** -0.5

        @pl.when(i * page_size < kv_len)
        def _attend():
            if variant in (
                "alpha_sign",
                "max_before_mask",
                "mask_added",
                "kv_head_by_modulo",
                "mask_one_key_past",
                "mask_hides_last_key",
            ):
                attend_page_by_hand(page_ref, q_ref, m_ref, l_ref, acc_ref, first_pos, kv_len,
                                    sm_scale, variant)  # fmt: skip
            else:
                attend_kv_block(page_ref, q_ref, m_ref, l_ref, acc_ref, first_pos, kv_len,
                                sm_scale)  # fmt: skip

        last = i == pl.num_programs(1) - 1
        if variant == "write_first_page":
            last = i == 0
        if variant == "write_on_last_page":  # the sequence's last page: none for kv_len 0
            last = i == pl.cdiv(kv_len, page_size) - 1

        @pl.when(last)
        def _finish():
            write_output(o_ref, l_ref, acc_ref)

    return functools.partial(scalar_prefetch.paged_decode_attention, kernel=kernel,
                             index_map=index_map)  # fmt: skip


def attend_page_by_hand(page_ref, q_ref, m_ref, l_ref, acc_ref, first_pos, kv_len, sm_scale,
                        variant):  # fmt: skip
    """attend_kv_block written out, with one of the online softmax's usual mistakes."""
    tokens, num_kv_heads, group = page_ref.shape[0], m_ref.shape[0], m_ref.shape[1]
    k_pos = first_pos + lax.broadcasted_iota(jnp.int32, (group, tokens), 1)
    for h in range(num_kv_heads):
        k = page_ref[:, 2 * h, :].astype(jnp.float32)
        v = page_ref[:, 2 * h + 1, :].astype(jnp.float32)
        v = jnp.where((k_pos[0] < kv_len)[:, None], v, 0.0)
        q = q_ref[h * group : (h + 1) * group, :].astype(jnp.float32)
        if variant == "kv_head_by_modulo":  # q head r reads KV head r % num_kv_heads
            q = q_ref[pl.ds(h, group, stride=num_kv_heads), :].astype(jnp.float32)
        s = jnp.dot(q, k.T) * sm_scale
        m_prev = m_ref[h]
        if variant == "max_before_mask":  # the max of scores the mask then hides
            m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            s = jnp.where(k_pos < kv_len, s, MASK)
        elif variant == "mask_added":  # a bias, as JAX's reference: NaN + MASK is still NaN
            s = s + jnp.where(k_pos < kv_len, 0.0, MASK)
            m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        else:
            visible = k_pos < kv_len
            if variant == "mask_one_key_past":  # <= : the key at position kv_len too
                visible = k_pos <= kv_len
            if variant == "mask_hides_last_key":  # kv_len - 1: the token's own key hidden
                visible = k_pos < kv_len - 1
            s = jnp.where(visible, s, MASK)
            m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        p = jnp.exp(s - m_next)
        alpha = jnp.exp(m_prev - m_next)
        if variant == "alpha_sign":  # exp(m_next - m_prev): the rescale upside down
            alpha = jnp.exp(m_next - m_prev)
        l_ref[h] = alpha * l_ref[h] + p.sum(axis=1, keepdims=True)
        acc_ref[h] = alpha * acc_ref[h] + jnp.dot(p, v)
        m_ref[h] = m_next


# --- rung 3: one buffer, one copy ---------------------------------------------------------------


def rung3(variant: str) -> Callable:
    def kernel(kv_lens_ref, page_indices_ref, q_ref, kv_hbm_ref, o_ref, buf, sem, m_ref, l_ref,
               acc_ref, *, sm_scale):  # fmt: skip
        seq, i = pl.program_id(0), pl.program_id(1)
        kv_len, page_size = kv_lens_ref[seq], buf.shape[0]

        @pl.when(i == 0)
        def _init():
            init_online_softmax(m_ref, l_ref, acc_ref)

        page = i if variant == "page_by_position" else page_indices_ref[seq, i]
        copy = pltpu.make_async_copy(kv_hbm_ref.at[page], buf, sem)

        def copy_and_attend():
            if variant == "wait_before_start":  # waits for a copy not started yet
                copy.wait()
                copy.start()
            elif variant == "no_wait":  # reads the buffer, never waiting for the copy
                copy.start()
            else:
                copy.start()
                if variant != "compute_then_wait":
                    copy.wait()
            attend_kv_block(buf, q_ref, m_ref, l_ref, acc_ref, i * page_size, kv_len, sm_scale)
            if variant == "compute_then_wait":
                copy.wait()

        if variant == "copy_every_step":  # copies page i even past the sequence's last page
            copy_and_attend()
        else:
            pl.when(i * page_size < kv_len)(copy_and_attend)

        @pl.when(i == pl.num_programs(1) - 1)
        def _finish():
            write_output(o_ref, l_ref, acc_ref)

    return functools.partial(async_copy.paged_decode_attention_async_copy, kernel=kernel)


# --- rung 4: double buffering --------------------------------------------------------------------


def rung4(variant: str) -> Callable:
    def kernel(kv_lens_ref, page_indices_ref, q_ref, kv_hbm_ref, o_ref, bufs, sems, m_ref, l_ref,
               acc_ref, *, sm_scale):  # fmt: skip
        seq = pl.program_id(0)
        kv_len, page_size = kv_lens_ref[seq], bufs.shape[1]
        num_pages = pl.cdiv(kv_len, page_size)

        def page_copy(i, slot):
            page = page_indices_ref[seq, i]
            sem = sems.at[0] if variant == "one_semaphore" else sems.at[slot]
            if variant == "one_slot":  # every page into slot 0
                slot = 0
            return pltpu.make_async_copy(kv_hbm_ref.at[page], bufs.at[slot], sem)

        def body(i, _):
            slot = i % 2
            if variant == "single_buffered":  # rung 3's loop: start, wait, compute, in slot 0
                page_copy(i, 0).start()
                page_copy(i, 0).wait()
                attend_kv_block(
                    bufs.at[0], q_ref, m_ref, l_ref, acc_ref, i * page_size, kv_len, sm_scale
                )
                return
            if variant == "no_overlap":  # page i started here, after page i - 1's wait
                page_copy(i, slot).start()
            elif variant == "unguarded_next":  # starts page i + 1 even after the last page
                page_copy(jnp.minimum(i + 1, page_indices_ref.shape[1] - 1), 1 - slot).start()
            else:

                @pl.when(i + 1 < num_pages)
                def _():
                    page_copy(i + 1, 1 - slot).start()

            if variant == "compute_before_wait":
                attend_kv_block(bufs.at[slot], q_ref, m_ref, l_ref, acc_ref, i * page_size,
                                kv_len, sm_scale)  # fmt: skip
                page_copy(i, slot).wait()
                return
            wait_slot = 1 - slot if variant == "wait_other_slot" else slot
            page_copy(i, wait_slot).wait()
            read = 0 if variant == "one_slot" else slot
            attend_kv_block(bufs.at[read], q_ref, m_ref, l_ref, acc_ref, i * page_size, kv_len,
                            sm_scale)  # fmt: skip

        init_online_softmax(m_ref, l_ref, acc_ref)
        if variant == "first_copy_unguarded":  # page 0 even for an empty slot
            page_copy(0, 0).start()
        elif variant not in ("no_overlap", "single_buffered"):
            pl.when(num_pages > 0)(lambda: page_copy(0, 0).start())
        lax.fori_loop(0, num_pages, body, None)
        write_output(o_ref, l_ref, acc_ref)

    return functools.partial(double_buffer.paged_decode_attention_double_buffered, kernel=kernel)


def edited(module, name: str, old: str, new: str) -> Callable:
    """The solution's kernel `name` of `module` with one line retyped, `old` -> `new`: the
    mistake as a learner makes it in their own copy (the rows of issue 67's fresh try)."""
    source = textwrap.dedent(inspect.getsource(getattr(module, name)))
    if source.count(old) != 1:
        raise ValueError(f"{old=} must occur once in {name}")
    namespace = dict(vars(module))
    exec(compile(source.replace(old, new), f"<learner's {name}>", "exec"), namespace)
    calls = {
        "prefill_chunk_kernel": prefill_chunk.prefill_chunk_attention,
        "ragged_kernel": ragged.ragged_paged_attention_ladder,
    }
    return functools.partial(calls[name], kernel=namespace[name])


def W(rung, name, checker, make, *expect, fast=False):  # noqa: N802  (a table row)
    return WrongAnswer(rung, name, checker, make, expect, fast)


WRONG_ANSWERS = [
    # rung 1a: the kernel body
    W("1a", "no alpha rescale", ex.check_flash_attention, lambda: flash_body("no_rescale"),
      "not rescaled", fast=True),
    W("1a", "init on every step", ex.check_flash_attention,
      lambda: flash_body("init_every_step"), "initialised on every KV block"),
    W("1a", "q offset without kv_len - q_len", ex.check_flash_attention,
      lambda: flash_body("no_kv_offset"), "kv_len - q_len` is missing"),
    W("1a", "q offset without the block", ex.check_flash_attention,
      lambda: flash_body("no_block_offset"), "i * block_q` of the q block is missing"),
    W("1a", "output written early", ex.check_flash_attention, lambda: flash_body("write_first"),
      "written on the first KV block"),
    W("1a", "no init", ex.check_flash_attention, lambda: flash_body("no_init"),
      "m, l and acc are not initialised: scratch starts as NaN"),
    W("1a", "V not zeroed", ex.check_flash_attention, lambda: flash_body("v_not_zeroed"),
      "the rows of V past kv_len are not zeroed", "0 * NaN"),
    W("1a", "alpha upside down", ex.check_flash_attention, lambda: flash_body("alpha_sign"),
      "alpha is upside down: alpha = exp(m_prev - m_next)"),
    W("1a", "max before the mask", ex.check_flash_attention,
      lambda: flash_body("max_before_mask"), "the running max was taken before the mask"),
    W("1a", "output never written", ex.check_flash_attention, lambda: flash_body("write_never"),
      "the output was never written"),
    W("1a", "no causal mask", ex.check_flash_attention, lambda: flash_body("no_causal_mask"),
      "no causal mask"),
    W("1a", "causal mask hides the diagonal", ex.check_flash_attention,
      lambda: flash_body("diagonal_hidden"), "hides each row's own key", "`k_pos <= q_pos`"),
    W("1a", "causal mask one key too wide", ex.check_flash_attention,
      lambda: flash_body("one_future_key"), "one key too wide", "`k_pos <= q_pos`"),
    W("1a", "no sm_scale", ex.check_flash_attention, lambda: flash_body("no_sm_scale"),
      "sm_scale"),
    W("1a", "1/sqrt(head_dim) for sm_scale", ex.check_flash_attention,
      lambda: flash_body("head_dim_scale"), "1 / sqrt(head_dim), not by the sm_scale"),
    W("1a", "mask added, not selected", ex.check_flash_attention,
      lambda: flash_body("mask_added"), "the mask is added to the scores",
      "NaN + mask_value is still NaN"),
    # rung 1b: the pallas_call
    W("1b", "KV axis parallel", ex.check_flash_pallas_call, lambda: flash_call("all_parallel"),
      'the KV axis is "parallel"', fast=True),
    W("1b", "K/V index map uses i", ex.check_flash_pallas_call,
      lambda: flash_call("kv_map_uses_i"), "index map of K"),
    W("1b", "K/V index map ignores j", ex.check_flash_pallas_call,
      lambda: flash_call("kv_map_ignores_j"), "index map of K"),
    W("1b", "K/V index map as offsets", ex.check_flash_pallas_call,
      lambda: flash_call("kv_map_offsets"), "not element offsets"),
    W("1b", "output index map uses j", ex.check_flash_pallas_call,
      lambda: flash_call("out_map_uses_j"), "out-of-bounds", "the output's block is the same"),
    W("1b", "grid axes swapped", ex.check_flash_pallas_call, lambda: flash_call("grid_swapped"),
      "axes", "swapped", "(num_heads, q_len // block_q, cdiv(kv_len, block_kv))"),
    W("1b", "grid to max_kv_len", ex.check_flash_pallas_call,
      lambda: flash_call("grid_to_max_kv_len"), "the grid is (2, 2, 4)"),
    W("1b", "acc in bf16", ex.check_flash_pallas_call, lambda: flash_call("acc_bf16"),
      "acc_ref", "float32"),
    W("1b", "m and l full width", ex.check_flash_pallas_call,
      lambda: flash_call("m_l_full_width"), "m_ref"),
    W("1b", "interpret=True hard-coded", ex.check_flash_pallas_call,
      lambda: flash_call("interpret_true"), "ignores the `interpret` argument"),
    W("1b", "kernel argument ignored", ex.check_flash_pallas_call,
      lambda: flash_call("ignores_kernel"), "ignores the `kernel` argument"),
    # rung 2
    W("2", "no clamp", ex.check_paged_decode_attention, lambda: rung2("no_clamp"),
      "out-of-bounds", "Clamp", fast=True),
    W("2", "clamp off by one", ex.check_paged_decode_attention,
      lambda: rung2("clamp_off_by_one"), "out-of-bounds", "Clamp"),
    W("2", "empty slot reads its row", ex.check_paged_decode_attention,
      lambda: rung2("empty_slot_reads_its_row"), "out-of-bounds", "no page at all"),
    W("2", "page by position", ex.check_paged_decode_attention,
      lambda: rung2("page_by_position"), "page table is not used"),
    W("2", "init every page", ex.check_paged_decode_attention, lambda: rung2("init_every_page"),
      "initialised on every grid step"),
    W("2", "positions from zero", ex.check_paged_decode_attention,
      lambda: rung2("positions_from_zero"), "first_pos"),
    W("2", "written after the first page", ex.check_paged_decode_attention,
      lambda: rung2("write_first_page"), "only the first page counts"),
    W("2", "element offset as the block index", ex.check_paged_decode_attention,
      lambda: rung2("element_offset"), "out-of-bounds", "element offset", "(page, 0, 0, 0)"),
    W("2", "another sequence's kv_len", ex.check_paged_decode_attention,
      lambda: rung2("kv_len_of_page_axis"), "out-of-bounds", "kv_lens_ref[seq]",
      "another sequence's kv_len"),
    W("2", "alpha upside down", ex.check_paged_decode_attention, lambda: rung2("alpha_sign"),
      "alpha = exp(m_prev - m_next)"),
    W("2", "max before the mask", ex.check_paged_decode_attention,
      lambda: rung2("max_before_mask"), "max was taken before the mask"),
    W("2", "mask added, not selected", ex.check_paged_decode_attention,
      lambda: rung2("mask_added"), "the mask is added to the scores"),
    W("2", "output written on the sequence's last page", ex.check_paged_decode_attention,
      lambda: rung2("write_on_last_page"), "never written", "kv_len 0"),
    W("2", "q heads grouped by modulo", ex.check_paged_decode_attention,
      lambda: rung2("kv_head_by_modulo"), "h // group"),
    W("2", "1/sqrt(head_dim) for sm_scale", ex.check_paged_decode_attention,
      lambda: rung2("head_dim_scale"), "1 / sqrt(head_dim), not by the sm_scale"),
    W("2", "length mask one key too wide", ex.check_paged_decode_attention,
      lambda: rung2("mask_one_key_past"), "the length mask is one key too wide",
      "each of these mistakes gives NaN just where yours does"),
    W("2", "length mask hides the last key", ex.check_paged_decode_attention,
      lambda: rung2("mask_hides_last_key"), "the length mask hides the token's own key"),
    W("2", "clamp to -1 on an empty slot, guarded", ex.check_paged_decode_attention,
      lambda: rung2("clamp_to_minus_one"), "read page_indices[2, -1]", "outside the table",
      "jnp.maximum(num_pages - 1, 0)", fast=True),  # reads column -1
    W("2", "clamp to -1 on an empty slot", ex.check_paged_decode_attention,
      lambda: rung2("clamp_to_minus_one_unguarded"), "out-of-bounds", "kv_len 0",
      "jnp.maximum(num_pages - 1, 0)"),
    # rung 3
    W("3", "no wait", ex.check_paged_decode_async_copy, lambda: rung3("no_wait"),
      "never waited for", fast=True),
    W("3", "compute before wait", ex.check_paged_decode_async_copy,
      lambda: rung3("compute_then_wait"), "DMA race on buf"),
    W("3", "wait before start", ex.check_paged_decode_async_copy,
      lambda: rung3("wait_before_start"), "deadlock"),
    W("3", "copy every step", ex.check_paged_decode_async_copy,
      lambda: rung3("copy_every_step"), "out-of-bounds", "does not have"),
    W("3", "page by position", ex.check_paged_decode_async_copy,
      lambda: rung3("page_by_position"), "page table is not used"),
    # rung 4
    W("4", "one slot", ex.check_double_buffered_decode, lambda: rung4("one_slot"),
      "overwrote a slot still in use", fast=True),
    W("4", "one semaphore", ex.check_double_buffered_decode, lambda: rung4("one_semaphore"),
      "two slots share one semaphore"),
    W("4", "next page unguarded", ex.check_double_buffered_decode,
      lambda: rung4("unguarded_next"), "out-of-bounds", "i + 1 < cdiv"),
    W("4", "first copy unguarded", ex.check_double_buffered_decode,
      lambda: rung4("first_copy_unguarded"), "out-of-bounds", "empty slot"),
    W("4", "wait on the other slot", ex.check_double_buffered_decode,
      lambda: rung4("wait_other_slot"), "overwrote",
      "its own slot's semaphore"),
    W("4", "compute before wait", ex.check_double_buffered_decode,
      lambda: rung4("compute_before_wait"), "DMA race on bufs"),
    W("4", "next page started after this page's wait", ex.check_double_buffered_decode,
      lambda: rung4("no_overlap"), "no copy was in flight when it started", "*before* waiting",
      "overlaps at most page i's compute"),
    W("4", "single-buffered, right output", ex.check_double_buffered_decode,
      lambda: rung4("single_buffered"), "no copy was in flight when it started",
      "Your kernel's output is right on this case, checked against the reference",
      "this rung requires double buffering"),
    # rung 5
    W("5", "first page started every step", ex.check_prefetching_decode,
      lambda: rung5("first_copy_every_step"), "overwrote",
      "only grid step 0", fast=True),
    W("5", "<= for <", ex.check_prefetching_decode, lambda: rung5("le_for_lt"),
      "out-of-bounds", "not `<=`"),
    W("5", "slot not carried", ex.check_prefetching_decode, lambda: rung5("slot_not_carried"),
      "slot_ref"),
    W("5", "empty slots not skipped", ex.check_prefetching_decode,
      lambda: rung5("no_skip_empty"), "out-of-bounds", "skip kv_len 0"),
    W("5", "first copy of seq 0", ex.check_prefetching_decode,
      lambda: rung5("first_copy_of_seq_0"), "a copy of a page no sequence has"),
    W("5", "next past the last", ex.check_prefetching_decode,
      lambda: rung5("next_past_the_last"), "out-of-bounds"),
    W("5", "next into the same slot", ex.check_prefetching_decode,
      lambda: rung5("next_into_same_slot"), "overwrote a slot still in use"),
    W("5", "no prefetch across steps", ex.check_prefetching_decode,
      rung5_no_prefetch_across_steps, "in its own grid step"),
    # rung 5a: next_work in Python
    W("5a", "stops at sequence end", ex.check_next_work,
      lambda: next_work_variant("stops_at_sequence_end"), "page 0 of the next sequence",
      fast=True),
    W("5a", "<= for <", ex.check_next_work, lambda: next_work_variant("le_for_lt"),
      "ceil(kv_len / page_size)"),
    W("5a", "empty slots not skipped", ex.check_next_work,
      lambda: next_work_variant("no_skip_empty"), "kv_len 0"),
    W("5a", "ignores num_seqs", ex.check_next_work,
      lambda: next_work_variant("ignores_num_seqs"), "num_seqs, not len(kv_lens)"),
    # rung 6: a prefill chunk
    W("6", "1/sqrt(head_dim) for sm_scale", ex.check_prefill_chunk,
      lambda: rung6("head_dim_scale"), "not by the sm_scale argument"),
    W("7", "1/sqrt(head_dim) for sm_scale", ex.check_ragged_paged_attention,
      lambda: rung7("head_dim_scale"), "not by the sm_scale argument"),
    W("6", "no causal offset", ex.check_prefill_chunk, lambda: rung6("no_kv_offset"),
      "kv_len - q_len` is missing", fast=True),
    W("6", "no q block offset", ex.check_prefill_chunk, lambda: rung6("no_block_offset"),
      "first row is missing from q_pos"),
    W("6", "no diagonal skip", ex.check_prefill_chunk, lambda: rung6("no_diagonal_skip"),
      "past the diagonal"),
    W("6", "last row not clamped to q_len", ex.check_prefill_chunk,
      lambda: rung6("last_row_unclamped"), "past the diagonal", "min(first_row + block_q, q_len)"),
    W("6", "blocks from the first row", ex.check_prefill_chunk,
      lambda: rung6("blocks_from_first_row"), "never copied", "*last* live row"),
    W("6", "dead q block not skipped", ex.check_prefill_chunk,
      lambda: rung6("dead_q_block_not_skipped"), "no live row"),
    W("6", "pages not clamped", ex.check_prefill_chunk, lambda: rung6("pages_unclamped"),
      "out-of-bounds", "cdiv(kv_len, page_size) - 1"),
    W("6", "page b + p", ex.check_prefill_chunk, lambda: rung6("page_b_plus_p"),
      "b * pages_per_block + p"),
    W("6", "every page into place 0", ex.check_prefill_chunk,
      lambda: rung6("all_pages_to_place_0"), "overwrote"),
    W("6", "next block into the same slot", ex.check_prefill_chunk,
      lambda: rung6("next_into_same_slot"), "overwrote", "1 - slot"),
    W("6", "no overlap", ex.check_prefill_chunk, lambda: rung6("no_overlap"),
      "no copy was in flight when it started", "*before* waiting",
      "Your kernel's output is right on this case, checked against the reference"),
    W("6", "first copy unguarded", ex.check_prefill_chunk,
      lambda: rung6("first_copy_unguarded"), "overwrote", "a q block with no live row starts"),
    W("6", "no init", ex.check_prefill_chunk, lambda: rung6("no_init"),
      "m, l or acc not initialised"),
    # rung 7: the ragged batch
    W("7", "no row mask on the write", ex.check_ragged_paged_attention,
      lambda: rung7("no_row_mask"), "each sequence writes only its own rows", fast=True),
    W("7", "state not reset per sequence", ex.check_ragged_paged_attention,
      lambda: rung7("no_reset"), "not reset between the sequences"),
    W("7", "q_pos from the batch's row", ex.check_ragged_paged_attention,
      lambda: rung7("global_row"), "row - q_start"),
    W("7", "no causal offset", ex.check_ragged_paged_attention, lambda: rung7("no_kv_offset"),
      "kv_len - q_len` is missing"),
    W("7", "walk does not skip q_len 0", ex.check_ragged_paged_attention,
      lambda: rung7("walk_no_skip_idle"), "q_len 0"),
    W("7", "next_work does not skip q_len 0", ex.check_ragged_paged_attention,
      lambda: rung7("next_no_skip_idle"), "q_len 0"),
    W("7", "next q block from seq + 1", ex.check_ragged_paged_attention,
      lambda: rung7("next_block_skips_seq"), "ended mid-sequence", fast=True),  # reads column -1
    W("7", "no prefetch across grid steps", ex.check_ragged_paged_attention,
      lambda: rung7("no_prefetch_across_steps"), "in its own grid step"),
    W("7", "slot not carried", ex.check_ragged_paged_attention,
      lambda: rung7("slot_not_carried"), "slot_ref[0]"),
    W("7", "first copy in every step", ex.check_ragged_paged_attention,
      lambda: rung7("first_copy_every_step"), "only grid step 0"),
    W("7", "KV blocks to the sequence's end", ex.check_ragged_paged_attention,
      lambda: rung7("blocks_to_q_end"), "past the diagonal", "*in this q block*"),
    W("7", "next past the last", ex.check_ragged_paged_attention,
      lambda: rung7("next_past_the_last"), "the very last work has no next"),
    W("7", "walk from sequence 0", ex.check_ragged_paged_attention,
      lambda: rung7("walk_from_seq_0"), "no row in q block"),
    W("7", "num_seqs ignored", ex.check_ragged_paged_attention,
      lambda: rung7("ignores_num_seqs"), "num_seqs"),
    W("7", "next into the same slot", ex.check_ragged_paged_attention,
      lambda: rung7("next_into_same_slot"), "1 - slot"),
    W("7", "<= for <", ex.check_ragged_paged_attention, lambda: rung7("le_for_lt"),
      "not `<=`"),
    W("7", "mask_value ignored", ex.check_ragged_paged_attention,
      lambda: rung7("ignores_mask_value"), "mask_value=-3.0", "mask_value is ignored",
      "attend_rows(..., sm_scale, mask_value)"),
    # causes that are true (issue 67): each names only what it checked
    W("6", "next block started after this block's wait", ex.check_prefill_chunk,
      lambda: rung6("next_after_wait"), "no copy was in flight when it started",
      "overlaps at most block b's compute", "Your kernel's output is right on this case"),
    W("7", "next block started after this block's wait", ex.check_ragged_paged_attention,
      lambda: rung7("next_after_wait"), "no copy was in flight when it started",
      "Your kernel's output is right on this case"),
    W("6", "single-buffered, right output", ex.check_prefill_chunk,
      lambda: rung6("single_buffered"), "into slot 0, where slot 1 was due",
      "Your kernel's output is right on this case", "the schedule of its copies is"),
    W("6", "no diagonal skip, right output", ex.check_prefill_chunk,
      lambda: rung6("no_diagonal_skip"), "past the diagonal",
      "Your kernel's output is right on this case", "the schedule of its copies is"),
    W("6", "KV blocks counted with a floor", ex.check_prefill_chunk,
      lambda: rung6("kv_blocks_floor"), "never copied", "The output is wrong too"),
    W("7", "KV blocks counted with a floor", ex.check_ragged_paged_attention,
      lambda: rung7("kv_blocks_floor"), "the plan has KV block 0 of sequence 2 for q block 0",
      "counted with a floor", "pl.cdiv(last_pos + 1, block_kv)"),
    W("7", "KV blocks counted without + 1", ex.check_ragged_paged_attention,
      lambda: rung7("cdiv_without_plus_one"), "counted as `cdiv(last_pos, block_kv)`"),
    W("7", "two pages per KV block hard-coded", ex.check_ragged_paged_attention,
      lambda: rung7("two_pages_per_block"), "num_kv_pages_per_block=3",
      "every KV block was copied as 2 page(s)", "bufs.shape[1] // page_size"),
    W("7", "next_work's cases swapped", ex.check_ragged_paged_attention,
      lambda: rung7("next_branches_swapped"), "the kernel copied KV block 0 of sequence 3",
      "next_work's cases in the wrong order", "sequence 2 still has rows in q block 0"),
    W("7", "next q block's first copy never started", ex.check_ragged_paged_attention,
      lambda: rung7("next_blk_never_started"), "the first of q block 1, was never started",
      "grid step 1 then waited for it", "deadlock"),
    W("7", "spanning sequence skipped where it starts", ex.check_ragged_paged_attention,
      lambda: rung7("skip_spanning_seq"),
      "sequence 3's rows in q block 0 (rows 6..7, where it starts) were not walked"),
    W("7", "a sequence walked where it has no row", ex.check_ragged_paged_attention,
      lambda: rung7("walk_past_end_row"), "the kernel copied that block, but in grid step 1",
      "sequence 5 has no row in q block 1", "Your kernel's output is right on this case"),
    W("7", "walk from sequence 0, right output", ex.check_ragged_paged_attention,
      lambda: rung7("walk_from_seq_0"), "sequence 2 has no row in q block 1",
      "the schedule of its copies is"),
    W("7", "slot not carried: which of block, slot, step", ex.check_ragged_paged_attention,
      lambda: rung7("slot_not_carried"), "the kernel copied that block, but into slot 1 "
      "(the plan: slot 0)", "slot_ref[0]"),
    W("7", "own step: which of block, slot, step", ex.check_ragged_paged_attention,
      lambda: rung7("no_prefetch_across_steps"), "the kernel copied that block, but into slot "
      "0 (the plan: slot 1) and in grid step 1", "in its own grid step",
      "this rung requires prefetching across grid steps"),
    W("6", "pages_per_block read as bufs.shape[1]", ex.check_prefill_chunk,
      lambda: rung6("pages_per_block_tokens"), "Out of bound slice",
      "of ladder_wrong_walks.py: pl.when(num_kv_blocks > 0)(lambda: copy(0, 0).start())"),
    # numerical mistakes, simulated and named
    W("6", "causal offset one too many", ex.check_prefill_chunk,
      lambda: rung6("causal_plus_one"), "the causal offset is one too many"),
    W("6", "causal offset one too few", ex.check_prefill_chunk,
      lambda: rung6("causal_minus_one"), "the causal offset is one too few"),
    W("6", "no sm_scale", ex.check_prefill_chunk, lambda: rung6("no_sm_scale"),
      "the scores are not scaled"),
    W("7", "causal offset one too many", ex.check_ragged_paged_attention,
      lambda: rung7("causal_plus_one"), "the causal offset is one too many"),
    W("7", "causal offset one too few", ex.check_ragged_paged_attention,
      lambda: rung7("causal_minus_one"), "the causal offset is one too few"),
    W("7", "no sm_scale", ex.check_ragged_paged_attention, lambda: rung7("no_sm_scale"),
      "the scores are not scaled"),
    W("7", "q_pos from the q block", ex.check_ragged_paged_attention,
      lambda: rung7("q_pos_from_q_block"), "q_pos counts the row's place in its q block"),
    W("7", "q_pos without first_row", ex.check_ragged_paged_attention,
      lambda: rung7("q_pos_no_first_row"), "first_row is missing from q_pos"),
    W("7", "row mask from the q block's own rows", ex.check_ragged_paged_attention,
      lambda: rung7("rows_block_local"), "the row mask compares the row's place in its q block",
      "rows = (q_start <= row) & (row < q_start + q_len)"),
    W("7", "row without first_row, for mask and q_pos", ex.check_ragged_paged_attention,
      lambda: rung7("row_no_first_row"), "first_row is missing from `row`",
      "both the row mask and q_pos count from the q block"),
    # a fresh try (issue 67): the solution with one line retyped
    W("6", "state initialised on the first q block only", ex.check_prefill_chunk,
      lambda: edited(prefill_chunk, "prefill_chunk_kernel",
                     "    init_online_softmax(m_ref, l_ref, acc_ref)\n",
                     "    pl.when(i == 0)(lambda: init_online_softmax(m_ref, l_ref, acc_ref))\n"),
      "m, l or acc not initialised before the first KV block"),
    W("7", "every KV block up to kv_len", ex.check_ragged_paged_attention,
      lambda: edited(ragged, "ragged_kernel", "return pl.cdiv(kv_len - (q_end - q_start) + "
                     "(last_row - q_start) + 1, block_kv)", "return pl.cdiv(kv_len, block_kv)"),
      "the kernel copied KV block 1 of sequence 3 in grid step 0",
      "KV blocks past the diagonal were copied"),
    W("7", "sm_scale and mask_value swapped", ex.check_ragged_paged_attention,
      lambda: edited(ragged, "ragged_kernel", "kv_len, sm_scale, mask_value)",
                     "kv_len, mask_value, sm_scale)"),
      "sm_scale and mask_value are swapped"),
    W("7", "every row at the last position", ex.check_ragged_paged_attention,
      lambda: edited(ragged, "ragged_kernel", "q_pos = kv_len - q_len + row - q_start",
                     "q_pos = kv_len - 1 + 0 * row"),
      "no causal mask: every row sees every key of the KV blocks visited"),
]  # fmt: skip

"""Notebook 07's kernel exercises: flash attention over dense K/V, rung 1 of the ladder.

Two checkers, one per half of a Pallas kernel:

* `check_flash_attention`, here: the kernel body, in the library's `pallas_call`
  (`minilib.ladder.flash.flash_attention`);
* `check_flash_pallas_call` (`ex07_flash_call`): the `pallas_call` itself (the grid, the
  BlockSpecs and their index maps, the scratch shapes, `dimension_semantics`), around the
  library's kernel body.

Both compare with plain jnp on cases the notebook never showed, K and V NaN past kv_len. A
wrong output is matched against the usual mistakes, made by `flash_simulation` (the kernel's
algorithm in NumPy, one mistake at a time). A wrong `pallas_call` is probed: the library's kernel
is swapped for one that reports, per grid step, which blocks of q, K and V it was given.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from minilib.exercises.checking import SM_SCALE_IGNORED, Case, CheckResult
from minilib.exercises.kernel_checking import check_kernel
from minilib.exercises.kernel_run import run_in_strict_interpret_mode
from minilib.ladder.flash import flash_attention, flash_attention_reference
from minilib.options import DEFAULT_MASK_VALUE
from minilib.tpu.numerics import BF16_PASS_TOLERANCE, one_bf16_pass

__all__ = [
    "check_flash_attention",
    "flash_attention",
    "flash_simulation",
]


def _cases(seed: int) -> list[Case]:
    rng = np.random.default_rng(700 + seed)
    cases = []
    # (num_heads, q_len, max_kv_len, kv_len, head_dim, block_q, block_kv)
    # Every size differs from one case to the other, block_q != block_kv, and each case has
    # several q blocks and several KV blocks.
    specs = [
        (2, 16, 64, 37, 128, 8, 16),  # NaN past key 37: 2 q blocks, 3 KV blocks, the last partial
        # a whole number of KV blocks; kv_len = q_len (a prompt from its first token) or not
        (3, 32, 40, int(rng.choice([32, 40])), 64, 16, 8),
    ]
    for num_heads, q_len, max_kv_len, kv_len, head_dim, block_q, block_kv in specs:
        q, k, v = (
            jnp.asarray(rng.standard_normal((num_heads, n, head_dim)), jnp.float32)
            for n in (q_len, max_kv_len, max_kv_len)
        )
        k, v = k.at[:, kv_len:].set(jnp.nan), v.at[:, kv_len:].set(jnp.nan)
        what = (
            f"num_heads={num_heads}, q_len={q_len}, kv_len={kv_len} (NaN up to "
            f"max_kv_len={max_kv_len}), head_dim={head_dim}, block_q={block_q}, "
            f"block_kv={block_kv}"
        )
        # Never head_dim ** -0.5 (0.088, 0.125): a kernel that ignores sm_scale shows.
        sm_scale = {128: 0.05, 64: 0.25}[head_dim]
        what += f", sm_scale={sm_scale}"
        options = dict(kv_len=kv_len, sm_scale=sm_scale, block_q=block_q,
                       block_kv=block_kv)  # fmt: skip
        cases.append(Case(what, (q, k, v), options))
    return cases


def _compile_case() -> Case:
    num_heads, q_len, max_kv_len, head_dim = 2, 128, 256, 128
    return Case(
        f"bf16, num_heads={num_heads}, q_len={q_len}, kv_len=200, head_dim={head_dim}, "
        "block_q=32, block_kv=128",
        (
            jax.ShapeDtypeStruct((num_heads, q_len, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((num_heads, max_kv_len, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((num_heads, max_kv_len, head_dim), jnp.bfloat16),
        ),
        dict(kv_len=200, sm_scale=head_dim**-0.5, block_q=32, block_kv=128),
    )


# --- the usual mistakes ------------------------------------------------------------------------


@np.errstate(invalid="ignore", divide="ignore", over="ignore")  # NaN keys give NaN, silently
def flash_simulation(
    q, k, v, *, kv_len: int, sm_scale: float, block_q: int, block_kv: int,
    rescale: bool = True, init_every_step: bool = False, q_offset: str = "right",
    write_after_first_block: bool = False, causal: bool = True, zero_v: bool = True,
    mask_past_kv_len: bool = True, mask_value: float = DEFAULT_MASK_VALUE,
    alpha_upside_down: bool = False, diagonal: int = 0,
) -> np.ndarray:  # fmt: skip
    """The flash kernel's algorithm in NumPy, grid step by grid step; each keyword makes one
    of the usual mistakes (the defaults make none).

      rescale=False                 acc and l are not multiplied by alpha = exp(m_prev - m_next)
      init_every_step=True          m, l and acc are reset on every KV block, not only the first
      q_offset="no kv_len - q_len"  row r of q block i at position i * block_q + r
      q_offset="no block offset"    row r of q block i at position kv_len - q_len + r
      write_after_first_block=True  acc / l written on the first KV block, not the last
      causal=False, zero_v=False, mask_past_kv_len=False: a mask or the V zeroing left out
      alpha_upside_down=True        alpha = exp(m_next - m_prev): inf on the first block, NaN
      diagonal=-1, diagonal=1       the causal mask off by one: a row sees the keys at positions
                                    <= its own + diagonal (-1: not its own, `<`; 1: one future)

    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 8, 4)) for _ in range(3))
    >>> ref = flash_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
    ...                                 kv_len=8, sm_scale=0.5)
    >>> sim = flash_simulation(q, k, v, kv_len=8, sm_scale=0.5, block_q=4, block_kv=4)
    >>> bool(np.allclose(sim, ref, atol=1e-5))
    True
    >>> bool(np.allclose(flash_simulation(q, k, v, kv_len=8, sm_scale=0.5, block_q=4,
    ...                                   block_kv=4, rescale=False), ref, atol=1e-3))
    False
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    num_heads, q_len, head_dim = q.shape
    out = np.zeros_like(q)
    for h in range(num_heads):
        for i in range(q_len // block_q):
            rows = np.arange(i * block_q, (i + 1) * block_q)
            q_pos = {
                "right": kv_len - q_len + rows,
                "no kv_len - q_len": rows,
                "no block offset": kv_len - q_len + rows - i * block_q,
            }[q_offset][:, None]
            m = np.full((block_q, 1), -np.inf)
            l, acc = np.zeros((block_q, 1)), np.zeros((block_q, head_dim))
            for j in range(-(-kv_len // block_kv)):
                if init_every_step:
                    m, l, acc = np.full((block_q, 1), -np.inf), l * 0, acc * 0
                cols = np.arange(j * block_kv, (j + 1) * block_kv)
                k_pos = cols[None, :]
                masked = (k_pos > q_pos + diagonal) & causal  # causal=False: none masked
                if mask_past_kv_len:
                    masked = masked | (k_pos >= kv_len)
                kb, vb = k[h, cols], v[h, cols]
                if zero_v:
                    vb = np.where((cols < kv_len)[:, None], vb, 0.0)
                s = np.where(masked, mask_value, q[h, rows] @ kb.T * sm_scale)
                m_next = np.maximum(m, s.max(axis=1, keepdims=True))
                p = np.exp(s - m_next)
                alpha = np.exp(m - m_next) if rescale else 1.0
                if alpha_upside_down:
                    alpha = np.exp(m_next - m)
                l = alpha * l + p.sum(axis=1, keepdims=True)
                acc = alpha * acc + p @ vb
                m = m_next
                if write_after_first_block and j == 0:
                    break
            out[h, rows] = acc / l
    return out


def _mistakes() -> dict[str, Callable]:
    def simulated(**mistake):
        return lambda q, k, v, **options: flash_simulation(q, k, v, **options, **mistake)

    return {
        "acc and l are not rescaled: when the running max grows from m_prev to m_next, what was "
        "summed under m_prev must be multiplied by alpha = exp(m_prev - m_next) "
        "(`l = alpha * l + ...`, `acc = alpha * acc + ...`).": simulated(rescale=False),
        "m, l and acc are initialised on every KV block: initialise them only on the first, "
        "`pl.when(j == 0)`; scratch keeps them from one grid step to the next.": simulated(
            init_every_step=True
        ),
        "the q rows' positions: row r of q block i sits at kv_len - q_len + i * block_q + r; "
        "the `kv_len - q_len` is missing (the q rows are the *last* q_len tokens).": simulated(
            q_offset="no kv_len - q_len"
        ),
        "the q rows' positions: row r of q block i sits at kv_len - q_len + i * block_q + r; "
        "the `i * block_q` of the q block is missing.": simulated(q_offset="no block offset"),
        "the output was written on the first KV block: write acc / l on the last one, "
        "`pl.when(j == pl.num_programs(2) - 1)`.": simulated(write_after_first_block=True),
        "no causal mask: row i of q sits at position kv_len - q_len + i, and sees only the keys "
        "at positions <= its own.": simulated(causal=False),
        "the causal mask hides each row's own key too (the diagonal): a query at position i "
        "sees the keys at positions 0..i, its own included, so the test is `k_pos <= q_pos`, "
        "not `k_pos < q_pos`.": simulated(diagonal=-1),
        "the causal mask is one key too wide: a query at position i sees the keys at "
        "positions 0..i and none after them, so the test is `k_pos <= q_pos`; yours lets key "
        "i + 1 through too.": simulated(diagonal=1),
        "sm_scale is not applied to the scores (q @ k.T * sm_scale).": lambda q, k, v, **o: (
            flash_attention_reference(q, k, v, kv_len=o["kv_len"], sm_scale=1.0)
        ),
        SM_SCALE_IGNORED: lambda q, k, v, **o: flash_attention_reference(
            q, k, v, kv_len=o["kv_len"], sm_scale=q.shape[-1] ** -0.5
        ),
    }


# What NaN in the output means, once `_nan_probe` has found where it came from.
NAN_FROM = {
    "output": "the output was never written: it holds what its buffer held before (NaN here; "
    "run with memory starting at 0, it is 0). Write acc / l on the last KV block, "
    "`pl.when(j == pl.num_programs(2) - 1)`.",
    "scratch": "m, l and acc are not initialised: scratch starts as NaN here, garbage on a chip "
    "(run with memory starting at 0, the output has no NaN). Initialise them on the first KV "
    "block of every q block, `pl.when(j == 0)`: m to -inf, l and acc to 0.",
    "keys": "the running max was taken before the mask: the scores of the keys past kv_len "
    "(NaN here, garbage on a chip) then set m (with those keys 0, not NaN, the output is "
    "right). Mask first (`jnp.where(visible, s, mask_value)`), then take the max.",
    "added": "the mask is added to the scores (`s + jnp.where(visible, 0, mask_value)`, a "
    "bias, as JAX's reference does) rather than selected: the scores of the keys past kv_len "
    "are NaN here (garbage on a chip), and NaN + mask_value is still NaN, as is NaN * 0 (with "
    "those keys finite, however large, the output is right). Select instead: "
    "`jnp.where(visible, s, mask_value)` drops a masked score whatever it holds.",
    "values": "the rows of V past kv_len are not zeroed: a masked score gives p = 0, but "
    "0 * NaN = NaN in p @ v (with those rows 0, not NaN, the output is right). Zero them "
    "with `jnp.where(k_pos.T < kv_len, v, 0.0)`.",
    "alpha": "alpha is upside down: alpha = exp(m_prev - m_next), at most 1. exp(m_next - "
    "m_prev) is inf on the first KV block, where m_prev = -inf, and inf * 0 = NaN (NaN even "
    "with every input finite and memory starting at 0).",
}


def _nan_probe(fn: Callable) -> Callable:
    """`diagnose(run, case)` for `check_kernel`: where a NaN in the output came from, found by
    running `fn` again with one thing changed at a time. With memory starting at 0 instead of
    NaN: 0 where the NaN was means the output was never written, no NaN at all means m, l or
    acc were not initialised. Then with the keys and values past kv_len 0 instead of NaN:
    right means the NaN came from them (the keys alone: the max taken before the mask, or the
    mask added to the scores, told apart by keys past kv_len that are finite and score far
    above the rest: right only when the mask was added; else V not zeroed). NaN still, just
    where the simulation of alpha upside down has it: alpha.
    None if the output has no NaN or nothing fits: the usual causes are listed then."""
    run = run_in_strict_interpret_mode(fn, uninitialized_memory="zero")

    def diagnose(got, case: Case) -> str | None:
        nan = ~np.isfinite(np.asarray(got.out, np.float64))
        if not nan.any():
            return None
        (q, k, v), o = case.args, case.kwargs
        expected = np.asarray(flash_attention_reference(q, k, v, kv_len=o["kv_len"],
                                                        sm_scale=o["sm_scale"]))  # fmt: skip
        tol = BF16_PASS_TOLERANCE if one_bf16_pass() else 1e-3

        def output(k, v):
            again = run(q, k, v, **o)
            return None if again.out is None else np.asarray(again.out, np.float64)

        def right(out):
            return out is not None and np.allclose(out, expected, atol=tol, rtol=tol)

        zeroed = output(k, v)
        if zeroed is not None and (zeroed[nan] == 0).all():
            return NAN_FROM["output"]
        if zeroed is not None and np.isfinite(zeroed).all():
            return NAN_FROM["scratch"]
        k0, v0 = (x.at[:, o["kv_len"] :].set(0.0) for x in (k, v))
        finite = output(k0, v0)
        if right(finite):
            if not right(output(k0, v)):
                return NAN_FROM["values"]
            # Finite garbage keys, scoring far above the real ones: a max taken before the
            # mask takes theirs, and the output is wrong; a mask added to them hides them.
            big = k0.at[:, o["kv_len"] :].set(1e4 * jnp.sign(q.sum(axis=1, keepdims=True)))
            return NAN_FROM["added"] if right(output(big, v0)) else NAN_FROM["keys"]
        upside_down = np.isnan(flash_simulation(q, k0, v0, **o, alpha_upside_down=True))
        if finite is not None and (upside_down == ~np.isfinite(finite)).all():
            return NAN_FROM["alpha"]
        return None

    return diagnose


def check_flash_attention(
    fn: Callable, *, seed: int = 0, verbose: bool = True, details: bool = False
) -> CheckResult:
    """Check `fn(q, k, v, *, kv_len, sm_scale, block_q, block_kv, interpret)`: causal flash
    attention as a Pallas kernel, q: [num_heads, q_len, head_dim], k and v:
    [num_heads, max_kv_len, head_dim] with NaN past kv_len.

    Runs it in TPU interpret mode (race detector on, scratch starting as NaN) against plain jnp
    attention, then, when libtpu is installed, compiles it for v5e with Mosaic.

    >>> from minilib.ladder.flash import flash_attention
    >>> check_flash_attention(flash_attention).status
    Passed: flash_attention matches the reference on all 2 cases...
    'passed'
    """
    return check_kernel(
        "flash_attention",
        fn,
        flash_attention_reference,
        _cases(seed),
        compile_case=_compile_case(),
        mistakes=_mistakes(),
        diagnose=_nan_probe(fn),
        verbose=verbose,
        details=details,
    )

"""Notebook 07's kernel exercises: flash attention over dense K/V, rung 1 of the ladder.

Two checkers, one per half of a Pallas kernel:

* `check_flash_attention`: the kernel body, in the library's `pallas_call`
  (`minilib.ladder.flash.flash_attention`);
* `check_flash_pallas_call`: the `pallas_call` itself (the grid, the BlockSpecs and their
  index maps, the scratch shapes, `dimension_semantics`), around the library's kernel body.
  Interpret mode visits a "parallel" axis in a shuffled order, as a megacore chip (v4, v5p) may
  split it over its two TensorCores: an axis that carries state and is marked "parallel" shows
  in the order its grid steps ran. The semantics of the other axes are read from the call.

Both compare with plain jnp on cases the notebook never showed, K and V NaN past kv_len. A
wrong output is matched against the usual mistakes, made by `flash_simulation` (the kernel's
algorithm in NumPy, one mistake at a time). A wrong `pallas_call` is probed: the library's kernel
is swapped for one that reports, per grid step, which blocks of q, K and V it was given.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from minilib.exercises.checking import Case, CheckResult, call_with_time_limit
from minilib.exercises.kernel_checking import check_kernel
from minilib.exercises.kernel_run import run_in_strict_interpret_mode
from minilib.ladder.flash import flash_attention, flash_attention_reference
from minilib.options import DEFAULT_MASK_VALUE
from minilib.tpu.numerics import BF16_PASS_TOLERANCE, one_bf16_pass

__all__ = [
    "check_flash_attention",
    "check_flash_pallas_call",
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
        options = dict(kv_len=kv_len, sm_scale=float(head_dim) ** -0.5, block_q=block_q,
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
    right means the NaN came from them (the keys alone: the max taken before the mask; else
    V not zeroed). NaN still, just where the simulation of alpha upside down has it: alpha.
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
            return NAN_FROM["keys"] if right(output(k0, v)) else NAN_FROM["values"]
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


# --- the pallas_call -----------------------------------------------------------------------------


def _grid_problem(run, case: Case) -> str | None:
    """What the order of the grid steps says about the call's grid and `dimension_semantics`:
    interpret mode shuffles the steps of a "parallel" axis. None if nothing is wrong."""
    points = [point for point, _ in run.grid]
    if not points or len(points[0]) != 3:
        return None
    q, _, _ = case.args
    o = case.kwargs
    expected = (q.shape[0], q.shape[1] // o["block_q"], -(-o["kv_len"] // o["block_kv"]))
    extents = tuple(max(p[a] for p in points) + 1 for a in range(len(points[0])))
    if extents != expected:
        return _wrong_grid(extents, expected)
    by_block: dict = {}
    for step, (point, core) in enumerate(run.grid):
        by_block.setdefault(point[:2], []).append((step, point[2], core))
    for (h, i), visits in sorted(by_block.items()):
        steps, js, cores = zip(*visits, strict=True)
        in_order = list(js) == sorted(js) and list(steps) == list(range(steps[0], steps[-1] + 1))
        if not in_order or len(set(cores)) > 1:
            return (
                f'the KV axis is "parallel": the KV blocks of head {h}, q block {i} ran in the '
                f"order {list(js)}" + (f", on cores {sorted(set(cores))}" if len(set(cores)) > 1
                                       else ", with other steps between them") + ". "
                "Its steps share state (m, l and acc in scratch: initialised at j == 0, read "
                "at every j, written out at the last), so they must run in order on one core: "
                'mark it "arbitrary". On one TensorCore the order happens to hold; a megacore '
                "chip (v4, v5p) may split and reorder a parallel axis."
            )  # fmt: skip
    return None


def _wrong_grid(grid: tuple, expected: tuple) -> str:
    swapped = sorted(grid) == sorted(expected)
    return (
        f"the grid is {grid}; expected (num_heads, q_len // block_q, cdiv(kv_len, block_kv)) = "
        f"{expected}"
        + (
            ": its axes are swapped. The order of the grid's axes is the order of the index "
            "maps' arguments (h, i, j)."
            if swapped
            else "."
        )  # fmt: skip
        + " KV blocks past kv_len hold no key at all, so the KV axis stops at cdiv(kv_len, "
        "block_kv); flash_kernel reads pl.program_id(1) as the q block and pl.program_id(2) "
        "as the KV block."
    )


def _pallas_call_params(fn: Callable, case: Case) -> dict | None:
    """The parameters of the `pallas_call` the call makes, read from its jaxpr (None if it
    cannot be traced or makes none)."""
    try:
        call = functools.partial(fn, interpret=False, **case.kwargs)
        jaxpr = jax.make_jaxpr(call)(*case.args)
    except Exception:
        return None
    for eqn in jaxpr.jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            return eqn.params
    return None


def _declared_grid(fn: Callable, case: Case) -> tuple | None:
    """The grid the call gives its `pallas_call` (None if unreadable)."""
    grid = getattr((_pallas_call_params(fn, case) or {}).get("grid_mapping"), "grid", None)
    return tuple(int(n) for n in grid) if grid is not None else None


def _grid_block_cause(fn: Callable) -> Callable:
    """An out-of-bounds block that comes from the grid, not from the index maps."""

    def cause(step: tuple, index: tuple, case: Case) -> str | None:
        q, o = case.args[0], case.kwargs
        expected = (q.shape[0], q.shape[1] // o["block_q"], -(-o["kv_len"] // o["block_kv"]))
        grid = _declared_grid(fn, case)
        return _wrong_grid(grid, expected) if grid is not None and grid != expected else None

    return cause


_TAG = 1000  # q, K, V of the probe: element [h, row, :] holds h * _TAG + row (+ an offset)


def _probe_pallas_call(fn: Callable, case: Case) -> str | None:
    """Run the learner's call with a kernel that reports, per grid step, its refs' shapes and
    the first row of each block; name the first block, shape or grid axis that is wrong."""
    from minilib.ladder.interpret import strict_interpret_params
    from minilib.ladder.watch import watch_kernel

    q, k, v = case.args
    o = case.kwargs
    num_heads, q_len, head_dim = q.shape
    block_q, block_kv = o["block_q"], o["block_kv"]
    tags = [
        jnp.asarray(
            np.broadcast_to(
                (np.arange(num_heads)[:, None] * _TAG + np.arange(n)[None, :] + offset)[..., None],
                (num_heads, n, head_dim),
            ),
            jnp.float32,
        )  # fmt: skip
        for n, offset in ((q_len, 0), (k.shape[1], 0), (k.shape[1], 0.5))
    ]
    shapes, steps = {}, []

    def probe(q_ref, k_ref, v_ref, o_ref, *scratch, **_):
        names = ("q_ref", "k_ref", "v_ref", "o_ref", "m_ref", "l_ref", "acc_ref")
        for n, ref in zip(names, (q_ref, k_ref, v_ref, o_ref, *scratch), strict=False):
            shapes[n] = (tuple(ref.shape), jnp.dtype(ref.dtype))
        shapes["scratch"] = len(scratch)
        ids = [pl.program_id(a) for a in range(3)]
        first = [
            r[0, 0] if len(r.shape) == 2 else r[(0,) * len(r.shape)] for r in (q_ref, k_ref, v_ref)
        ]
        jax.debug.callback(lambda *x: steps.append([float(t) for t in x]), *ids, *first)
        o_ref[...] = jnp.broadcast_to(q_ref[...], o_ref.shape).astype(o_ref.dtype)

    def run_probe():
        return fn(*tags, interpret=strict_interpret_params(), kernel=probe, **o)

    with watch_kernel() as watch:  # the learner's code: any error, any loop, is no answer
        finished, out, error = call_with_time_limit(run_probe, (), {}, 30, on_timeout=watch.stop)
    if not finished or error is not None:
        return None
    out = np.asarray(out)
    want = {
        "q_ref": (block_q, head_dim), "k_ref": (block_kv, head_dim),
        "v_ref": (block_kv, head_dim), "o_ref": (block_q, head_dim),
        "m_ref": (block_q, 1), "l_ref": (block_q, 1), "acc_ref": (block_q, head_dim),
    }  # fmt: skip
    for n, shape in want.items():
        got = shapes.get(n)
        if got is None:
            return f"the kernel gets no `{n}`: scratch_shapes must hold m, l and acc, in order."
        scratch = n in ("m_ref", "l_ref", "acc_ref")
        if got[0] != shape or (scratch and got[1] != jnp.float32):
            if scratch:
                return (
                    f"the scratch `{n}` is {got[1]}{list(got[0])}; the kernel wants "
                    f"float32{list(shape)}: m and l (block_q, 1), acc (block_q, head_dim), in "
                    "float32 so that the running sums keep their precision."
                )
            return (
                f"`{n}` is a block of shape {got[0]}; the kernel wants {shape}: the "
                "BlockSpec's block shape is (None, block, head_dim), None squeezing the head "
                "axis away."
            )
    for h, i, j, q_tag, k_tag, v_tag in steps:
        step = (int(h), int(i), int(j))
        expect = {
            "q": (h * _TAG + i * block_q, f"rows {int(i) * block_q}.. of head {int(h)}"),
            "K": (h * _TAG + j * block_kv, f"keys {int(j) * block_kv}.. of head {int(h)}"),
            "V": (h * _TAG + j * block_kv + 0.5, f"values {int(j) * block_kv}.. of head {int(h)}"),
        }
        for name, tag in (("q", q_tag), ("K", k_tag), ("V", v_tag)):
            want_tag, what = expect[name]
            if tag != want_tag:
                base = int(tag - 0.5) if name == "V" else int(tag)
                return (
                    f"the index map of {name}: grid step (h, i, j) = {step} was given "
                    f"{'keys' if name != 'q' else 'rows'} {base % _TAG}.. of head "
                    f"{base // _TAG}; it should see {what}. The index map returns *block* "
                    "indices: (h, i, 0) for q and the output, (h, j, 0) for K and V."
                )
    expected_out = np.asarray(tags[0])
    if out.shape != expected_out.shape or not np.array_equal(out, expected_out):
        return (
            "the output's index map: the blocks the kernel wrote did not land where their q "
            "rows came from. It is q's: (h, i, 0), the same block for every KV step j."
        )
    return None


def _declared_semantics(fn: Callable, case: Case) -> tuple | None:
    """The `dimension_semantics` the call gives its `pallas_call`, read from its jaxpr (None
    if it cannot be read). The pallas_call's compiler params hold them: a CompilerParams, or
    (jax 0.7) a dict of them by backend."""
    call_params = _pallas_call_params(fn, case)
    if call_params is None:
        return None
    params = call_params.get("compiler_params")
    if isinstance(params, Mapping):
        params = params.get("mosaic_tpu") or params.get("mosaic")
    semantics = getattr(params, "dimension_semantics", None)
    return tuple(str(x).lower() for x in semantics) if semantics else ()


def _semantics_problem(fn: Callable, case: Case) -> str | None:
    """One semantics per grid axis, each "parallel" or "arbitrary". (A "parallel" KV axis
    shows in the run itself: shuffled.)"""
    semantics = _declared_semantics(fn, case)
    if semantics is None:
        return None
    known = all("parallel" in x or "arbitrary" in x for x in semantics)
    if len(semantics) != 3 or not known:
        return (
            f"dimension_semantics={semantics or None}: give one per grid axis, "
            '"parallel" or "arbitrary". The KV axis carries state from one step to the next: '
            '"arbitrary". The heads and q-block axes carry none: "parallel", which lets a '
            "megacore chip (v4, v5p) split them over its two TensorCores: "
            '("parallel", "parallel", "arbitrary").'
        )
    return None


def _semantics_note(fn: Callable, case: Case) -> str | None:
    """A note for a right answer that marks the heads or q-block axis "arbitrary"."""
    semantics = _declared_semantics(fn, case)
    if not semantics or all("parallel" in x for x in semantics[:2]):
        return None
    return (
        f"Note: dimension_semantics={semantics} is correct: an 'arbitrary' axis runs in order, "
        "which is always safe (minilib's kernel and JAX's mark every axis 'arbitrary'). On a "
        "megacore chip (v4, v5p), 'parallel' on the heads and q-block axes lets its two "
        "TensorCores split them, where 'arbitrary' leaves one core idle; on v5e and v6e, one "
        "TensorCore a chip, the two run alike."
    )


def check_flash_pallas_call(
    fn: Callable, *, seed: int = 0, verbose: bool = True, details: bool = False
) -> CheckResult:
    """Check `fn(q, k, v, *, kv_len, sm_scale, block_q, block_kv, interpret, kernel)`: the
    `pallas_call` of rung 1 around `kernel` (default `minilib.ladder.flash.flash_kernel`),
    q: [num_heads, q_len, head_dim], k and v: [num_heads, max_kv_len, head_dim].

    The call must give the kernel the grid (num_heads, q_len // block_q,
    cdiv(kv_len, block_kv)), BlockSpecs whose index maps pick q block i and KV block j of
    head h, the scratch m, l (block_q, 1) and acc (block_q, head_dim) in float32, and
    `dimension_semantics` ("parallel", "parallel", "arbitrary"); "arbitrary" on the heads or
    q-block axis is correct too, and passes with a note on megacore. The order of its grid
    steps is recorded (interpret mode shuffles a "parallel" axis), the semantics it declares
    are read from its jaxpr, and a wrong output is probed.

    >>> check_flash_pallas_call(flash_attention).status
    Passed: flash_pallas_call matches the reference on all 2 cases...
    'passed'
    """
    cases = _cases(seed)
    result = check_kernel(
        "flash_pallas_call",
        fn,
        flash_attention_reference,
        cases,
        compile_case=_compile_case(),
        mistakes=_mistakes(),
        verbose=False,
        details=details,
        record_grid=True,
        diagnose=lambda run, case: _probe_pallas_call(fn, case) or _grid_problem(run, case),
        extra_check=lambda run, case: (
            _grid_problem(run, case) or (_semantics_problem(fn, case) if case is cases[0] else None)
        ),
        explain_error=lambda error, case: (
            _probe_pallas_call(fn, case) if isinstance(error, Exception) else None
        ),
        advice=_block_advice,
        block_cause=_grid_block_cause(fn),
    )
    note = _semantics_note(fn, cases[0]) if result.passed else None
    if note:
        result = dataclasses.replace(result, report=f"{result.report}\n{note}")
    if verbose:
        print(result.report)
    return result


def _block_advice(kind: str) -> str | None:
    if kind != "block":
        return None
    return (
        "an index map returned a block past the last one. Index maps return *block* indices, "
        "not element offsets: (h, i, 0) for q and the output, (h, j, 0) for K and V (block j "
        "starts at row j * block_kv); the output's block is the same for every KV step j."
    )

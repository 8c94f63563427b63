"""Notebook 07's rung 1b: the learner's `pallas_call` around the library's flash kernel body.

`check_flash_pallas_call` checks the `pallas_call` itself (the grid, the BlockSpecs and their
index maps, the scratch shapes, `dimension_semantics`) on `ex07_flash`'s cases, against plain
jnp, K and V NaN past kv_len. Interpret mode visits a "parallel" axis in a shuffled order, as
a megacore chip (v4, v5p) may split it over its two TensorCores: an axis that carries state and
is marked "parallel" shows in the order its grid steps ran. The semantics of the other axes are
read from the call. A wrong `pallas_call` is probed: the library's kernel is swapped for one
that reports, per grid step, which blocks of q, K and V it was given.
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
from minilib.exercises.ex07_flash import _cases, _compile_case, _mistakes
from minilib.exercises.kernel_checking import check_kernel
from minilib.ladder.flash import flash_attention, flash_attention_reference, flash_kernel

__all__ = ["check_flash_pallas_call", "flash_attention"]


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


def _kernel_or_interpret_problem(fn: Callable, case: Case) -> str | None:
    """The call must run the `kernel` it is given (the checker swaps in its own to probe the
    call) and pass on its `interpret` (False: compiled for a TPU). Read from its jaxpr, traced
    with `interpret=False` and a kernel that notes it was traced; None if all is well or the
    call cannot be traced."""
    traced = []

    def noting_kernel(*refs, **options):
        traced.append(True)
        return flash_kernel(*refs, **options)

    try:
        call = functools.partial(fn, interpret=False, kernel=noting_kernel, **case.kwargs)
        jaxpr = jax.make_jaxpr(call)(*case.args)
    except Exception:
        return None
    if not traced:
        return (
            "your pallas_call ignores the `kernel` argument: it runs a kernel of its own "
            "choosing (flash_kernel itself?). Pass `functools.partial(kernel, kv_len=..., "
            "q_len=..., sm_scale=...)` to pl.pallas_call, so that the body the caller gives is "
            "the one that runs (this checker swaps in its own to see what each grid step gets)."
        )
    calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    if calls and calls[0].params.get("interpret") not in (False, None):
        return (
            "your pallas_call ignores the `interpret` argument: called with interpret=False it "
            f"still runs in interpret mode (interpret={calls[0].params['interpret']!r}), so on "
            "a TPU it would never be compiled, and this checker's strict interpret mode (NaN "
            "scratch, race detector) never ran it. Pass `interpret=interpret` to pl.pallas_call."
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
            _grid_problem(run, case)
            or (
                _kernel_or_interpret_problem(fn, case) or _semantics_problem(fn, case)
                if case is cases[0]
                else None
            )
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

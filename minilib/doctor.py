"""`python -m minilib doctor`: where am I running, and does attention give the right answer?"""

from __future__ import annotations

import importlib.metadata
import time

import jax
import numpy as np

from minilib.tpu.numerics import BF16_PASS_TOLERANCE, one_bf16_pass

__all__ = [
    "doctor",
    "kernel_mode",
    "package_version",
    "parity_passes",
    "parity_smoke_check",
    "tpu_compile_check",
]


def package_version(name: str) -> str:
    """The installed version of a distribution, or 'not installed'.

    >>> package_version("jax") == jax.__version__, package_version("no-such-package")
    (True, 'not installed')
    """
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def kernel_mode(backend: str | None = None) -> str:
    """How minilib's Pallas kernel runs here: compiled on a TPU, TPU interpret mode elsewhere.

    >>> kernel_mode("tpu")
    'compiled (Mosaic, on the TPU)'
    >>> kernel_mode("cpu")
    'interpreted (TPU interpret mode on cpu: right answers, not TPU speed)'
    """
    backend = jax.default_backend() if backend is None else backend
    if backend == "tpu":
        return "compiled (Mosaic, on the TPU)"
    return f"interpreted (TPU interpret mode on {backend}: right answers, not TPU speed)"


def parity_smoke_check() -> tuple[dict[str, float], float]:
    """Run minilib's vectorized attention and its Pallas kernel (compiled on a TPU,
    interpreted elsewhere) against JAX's own reference on one small NaN-padded batch.
    Returns ({name: max abs error}, seconds).

    It compiles and runs both implementations (`doctor` prints how long that took), so the
    example is not run:

    >>> errors, seconds = parity_smoke_check()  # doctest: +SKIP
    >>> errors  # doctest: +SKIP
    {'jnp': 1.1920928955078125e-06, 'kernel': 4.76837158203125e-07}
    """
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ref_ragged_paged_attention as jax_reference,
    )

    from minilib.batch import make_batch
    from minilib.kernel import ragged_paged_attention
    from minilib.vectorized import ragged_paged_attention_jnp

    start = time.perf_counter()
    batch = make_batch(
        [(6, 6), (1, 20), (3, 11)], num_q_heads=4, num_kv_heads=2, head_dim=128, page_size=8
    )
    # JAX's reference loops over sequences in Python; jit with the lengths as constants
    # compiles that loop once instead of op by op.
    lengths = [np.asarray(a) for a in batch.args()[2:]]
    reference = jax.jit(lambda q, kv: jax_reference(q, kv, *lengths, sm_scale=0.125))
    # The reference's matmuls exact (HIGHEST), even where a float32 matmul at the default
    # precision is one bfloat16 pass (a TPU; minilib.tpu.numerics): the float32 answer.
    with jax.default_matmul_precision("highest"):
        expected = np.asarray(reference(batch.q, batch.kv_pages))
    errors = {}
    for name, fn in [("jnp", ragged_paged_attention_jnp), ("kernel", ragged_paged_attention)]:
        out = np.asarray(fn(*batch.args(), sm_scale=0.125))
        errors[name] = float(np.max(np.abs(out[: batch.num_tokens] - expected)))
    return errors, time.perf_counter() - start


def parity_passes(errors: dict[str, float]) -> bool:
    """Are `parity_smoke_check`'s errors small enough? Float32 rounding (1e-4) where float32
    matmuls are exact; where they are one bfloat16 pass (a TPU, or its emulation on the CPU),
    what that pass costs (`minilib.tpu.numerics.BF16_PASS_TOLERANCE`; the kernel measured
    0.0064 under the emulation).

    >>> parity_passes({"jnp": 1e-6, "kernel": float("nan")})
    False
    """
    tolerance = BF16_PASS_TOLERANCE if one_bf16_pass() else 1e-4
    return all(np.isfinite(err) and err < tolerance for err in errors.values())


def doctor() -> bool:
    """Print the environment report. Returns True when the parity check passes.

    It runs `parity_smoke_check`, and compiles the kernel for v5e where libtpu is installed,
    so the example is not run; on a CPU without libtpu it printed:

    >>> doctor()  # doctest: +SKIP
    backend:      cpu (cpu)
    jax:          0.10.2
    jaxlib:       0.10.2
    libtpu:       not installed
    Pallas kernel: interpreted (TPU interpret mode on cpu: right answers, not TPU speed)
    parity check: PASS: max |minilib - jax reference|: jnp 1.2e-06, kernel 4.8e-07 (6.5 s)
    TPU compile:  not available: libtpu is not installed (jax 0.10.2). Install it with: ...
    True
    """
    backend = jax.default_backend()
    print(f"backend:      {backend} ({jax.devices()[0].device_kind})")
    print(f"jax:          {jax.__version__}")
    print(f"jaxlib:       {package_version('jaxlib')}")
    print(f"libtpu:       {package_version('libtpu')}")
    print(f"Pallas kernel: {kernel_mode(backend)}")
    errors, seconds = parity_smoke_check()
    ok = parity_passes(errors)
    details = ", ".join(f"{name} {err:.1e}" for name, err in errors.items())
    verdict = "PASS" if ok else "FAIL"
    print(f"parity check: {verdict}: max |minilib - jax reference|: {details} ({seconds:.1f} s)")
    return tpu_compile_check() and ok


def tpu_compile_check() -> bool:
    """Report whether a TPU compile is available here (libtpu, no TPU needed); when it is,
    compile the kernel for v5e and print what the compiler made of it. Returns False only
    when libtpu is there and the kernel does not compile.

    With libtpu it compiles the kernel for v5e, so the example is not run; with libtpu
    0.0.42.1 it printed:

    >>> tpu_compile_check()  # doctest: +SKIP
    TPU compile:  PASS: libtpu 0.0.42.1 with jax 0.10.2; the kernel compiles for v5e: 4,560
    bundles per KV block, VMEM 9,172 KiB (static estimates, not timings; ...)
    True
    """
    from minilib.tpu.compile import tpu_compile_available

    ok, reason = tpu_compile_available()
    if not ok:
        print(f"TPU compile:  not available: {reason}")
        return True
    from minilib.tpu.kernel_costs import compile_rpa, rpa_specs

    report = compile_rpa("ours", rpa_specs(), chip="v5e")
    if not report.compiled:
        print(f"TPU compile:  FAIL: {reason}; the kernel did not compile for v5e:")
        print(report.error)
        return False
    print(
        f"TPU compile:  PASS: {reason}; the kernel compiles for v5e: "
        f"{report.bundles_per_kv_block:,} bundles per KV block, VMEM {report.vmem_bytes // 1024:,} "
        f"KiB (static estimates, not timings; python -m minilib compile compares with JAX's)"
    )
    return True

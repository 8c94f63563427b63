"""`python -m minilib doctor`: where am I running, and does attention give the right answer?"""

from __future__ import annotations

import importlib.metadata
import time

import jax
import numpy as np


def package_version(name: str) -> str:
    """The installed version of a distribution, or 'not installed'."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def kernel_mode(backend: str | None = None) -> str:
    """How minilib's Pallas kernel runs here: compiled on a TPU, TPU interpret mode elsewhere."""
    backend = jax.default_backend() if backend is None else backend
    if backend == "tpu":
        return "compiled (Mosaic, on the TPU)"
    return f"interpreted (TPU interpret mode on {backend}: right answers, not TPU speed)"


def parity_smoke_check() -> tuple[float, float]:
    """Run minilib's vectorized attention and JAX's own reference on one small NaN-padded
    batch. Returns (max abs error, seconds)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ref_ragged_paged_attention as jax_reference,
    )

    from minilib.batch import make_batch
    from minilib.vectorized import ragged_paged_attention_jnp

    start = time.perf_counter()
    batch = make_batch(
        [(6, 6), (1, 20), (3, 11)], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8
    )
    ours = ragged_paged_attention_jnp(*batch.args(), sm_scale=0.125)
    theirs = jax_reference(*batch.args(), sm_scale=0.125)
    err = float(np.max(np.abs(np.asarray(ours[: batch.num_tokens]) - np.asarray(theirs))))
    return err, time.perf_counter() - start


def doctor() -> bool:
    """Print the environment report. Returns True when the parity check passes."""
    backend = jax.default_backend()
    print(f"backend:      {backend} ({jax.devices()[0].device_kind})")
    print(f"jax:          {jax.__version__}")
    print(f"jaxlib:       {package_version('jaxlib')}")
    print(f"libtpu:       {package_version('libtpu')}")
    print(f"Pallas kernel: {kernel_mode(backend)}")
    err, seconds = parity_smoke_check()
    ok = bool(np.isfinite(err) and err < 1e-4)
    verdict = "PASS" if ok else "FAIL"
    print(f"parity check: {verdict}: max |minilib - jax reference| = {err:.2e} ({seconds:.1f} s)")
    return ok

"""Solutions to notebook 07 (Pallas basics)."""

import jax.numpy as jnp


def softmax_kernel(x_ref, o_ref):
    # x_ref, o_ref: [block_rows, cols], this program's rows.
    x = x_ref[...].astype(jnp.float32)
    e = jnp.exp(x - x.max(axis=-1, keepdims=True))  # every exponent <= 0: no overflow
    o_ref[...] = (e / e.sum(axis=-1, keepdims=True)).astype(o_ref.dtype)

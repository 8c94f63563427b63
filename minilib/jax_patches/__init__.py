"""Patches to JAX itself, applied when minilib is imported, each where the installed versions
need it and a no-op elsewhere. Each module says what it fixes and on which versions, and
`tests/` checks that the fix is still needed where it is applied, and that it works.

  mosaic_version.py  kernels lowered at the Mosaic IR version the installed libtpu reads
                     (Colab's jax 0.7.2 with libtpu 0.0.21.1: 7, not 8)
  literal_keys.py    jax 0.7's lowering of scalar constants in linear time, not quadratic
"""

from minilib.jax_patches import literal_keys, mosaic_version

__all__ = ["apply"]


def apply() -> None:
    """Apply every patch this jax and libtpu need. Idempotent.

    >>> apply()  # minilib applied them when imported: nothing changes
    """
    literal_keys.apply()
    mosaic_version.apply()

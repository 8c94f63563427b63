"""Lower Pallas kernels at a Mosaic IR version the installed libtpu can read.

A Pallas TPU kernel reaches libtpu as a Mosaic module, serialized at an *IR version*. jax
picks the version in `jax._src.tpu_custom_call.get_ir_version`, from the build date of the
libtpu it loaded: jax 0.7.2 writes version 7 for a libtpu built before 2025-08-14 and its
newest, 8, for any newer one. libtpu 0.0.21.1, which Colab's TPU runtime pairs with jax 0.7.2,
was built on 2025-08-25 yet reads versions up to 7 only, so every kernel fails to compile:
"Unsupported version: expected <= 7 but got 8". Lowered at version 7, the same kernels compile.

`apply()` (run when minilib is imported) does that in one place: where the installed jax
would write a newer version than the installed libtpu reads (`ir_version_cap`), it wraps
`get_ir_version` so that jax lowers at most at the version libtpu reads. jax looks that
function up at every lowering, so the cap holds for every kernel, on a real TPU as on the
compile-only devices of `minilib.tpu.compile`, a learner's own kernels included. On every
other pair of versions it does nothing. The versions are those pip installed (libtpu loaded
from elsewhere, through TPU_LIBRARY_PATH, is not seen).
"""

from __future__ import annotations

import jax

from minilib.chips import installed_libtpu

__all__ = ["NEWEST_READ", "NEWEST_WRITTEN", "apply", "ir_version_cap"]

# The newest Mosaic IR version a jax writes (for a libtpu built after the date in its
# `get_ir_version`), for the jax versions some libtpu in NEWEST_READ is paired with.
NEWEST_WRITTEN = {"0.7.2": 8}
# The newest Mosaic IR version a libtpu reads, for the libtpu versions that read less than
# a jax of NEWEST_WRITTEN writes for them (checked by hand: "expected <= 7 but got 8").
NEWEST_READ = {"0.0.21": 7, "0.0.21.1": 7}


def ir_version_cap(jax_version: str, libtpu_version: str | None) -> int | None:
    """The newest IR version to lower at with these versions, or None when jax's own choice
    is one libtpu reads.

    >>> ir_version_cap("0.7.2", "0.0.21.1"), ir_version_cap("0.7.2", "0.0.23")
    (7, None)
    >>> ir_version_cap("0.10.2", "0.0.42.1") is None
    True
    """
    written = NEWEST_WRITTEN.get(jax_version)
    read = NEWEST_READ.get(libtpu_version or "")
    return read if written is not None and read is not None and written > read else None


def apply() -> int | None:
    """Cap the IR version jax lowers kernels at, if this jax and libtpu need it; return the
    cap, or None (and change nothing) when they do not. Idempotent.

    >>> from jax._src import tpu_custom_call
    >>> cap = apply()  # minilib applied it when imported: nothing changes
    >>> cap == ir_version_cap(jax.__version__, installed_libtpu())
    True
    >>> getattr(tpu_custom_call.get_ir_version, "minilib_ir_version_cap", None) == cap
    True
    """
    cap = ir_version_cap(jax.__version__, installed_libtpu())
    if cap is None:
        return None
    from jax._src import tpu_custom_call

    jax_choice = tpu_custom_call.get_ir_version
    if getattr(jax_choice, "minilib_ir_version_cap", None) is not None:
        return cap  # already applied

    def get_ir_version(ctx):
        version = jax_choice(ctx)  # None: the newest, NEWEST_WRITTEN
        return cap if version is None or version > cap else version

    get_ir_version.minilib_ir_version_cap = cap
    get_ir_version.__wrapped__ = jax_choice
    tpu_custom_call.get_ir_version = get_ir_version
    return cap

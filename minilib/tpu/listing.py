"""A few lines of a raw bundle listing: our kernel's KV-block loop, as libtpu prints it.

`minilib.tpu.dump_reader` turns a kernel's `*-final_bundles.txt` into figures (bundles per KV
block, ops by kind). This module shows the text itself, a few lines of it: the first bundle of
each kind of work in the KV-block loop (`kv_block_loop`), one op of each, so that a reader can
see what a bundle, a DMA start, a semaphore wait and a matmul look like.

    pick_listing_lines(bundles_text)   those lines, from a dump's text (needs no libtpu)
    kv_loop_listing(chip)              our kernel compiled for `chip` (needs libtpu), picked
    recorded_listing()                 the lines recorded for v5e, for where nothing compiles
    recorded_listing_label()           when, with what and how they were recorded

`python -m minilib.tpu.listing > minilib/tpu/recorded_listing_v5e.txt` records them again
(with libtpu: `.venv-tpu`).
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

from minilib.tpu.bundles import COMMENT, DMA_START, MATMUL, kv_block_loop, parse_bundles
from minilib.tpu.dump_reader import SOURCE_LOC, libtpu_version, short_path
from minilib.tpu.labels import recorded_label

__all__ = [
    "RECORDED",
    "kv_loop_listing",
    "pick_listing_lines",
    "recorded_listing",
    "recorded_listing_label",
]

RECORDED = Path(__file__).with_name("recorded_listing_v5e.txt")
COMMAND = "python -m minilib.tpu.listing > minilib/tpu/recorded_listing_v5e.txt"
HEADER = r"# Recorded on (\S+) with jax (\S+), libtpu ([^:]+):"

# The ops picked, in the order a KV block needs them; each line of the excerpt is the first
# bundle of the KV-block loop that holds one (the loop's first bundle is shown too).
PICKED = (
    ("DMA start", DMA_START),
    ("semaphore wait", re.compile(r"=\s*dma\.done\.wait")),
    ("MXU weights push", re.compile(r"=\s*vmatpush")),
    ("matmul", MATMUL),
    ("MXU result pop", re.compile(r"=\s*vpop")),
)
# The kernel and block sizes: notebook 09's comparison case, 32 q rows per block.
CASE = dict(num_kv_pages_per_block=8, num_queries_per_block=32)


def pick_listing_lines(bundles_text: str) -> list[str]:
    """The lines of a `*-final_bundles.txt` worth reading first: the first bundle of the
    KV-block loop, then the first of the loop's bundles holding each op of `PICKED`, in the
    listing's order. Each shows one op (the one it was picked for), its source location cut
    to `file:line`, and how many other ops the bundle issues with it.

    >>> from minilib.tpu.bundles import EXAMPLE_BUNDLES
    >>> print("\\n".join(pick_listing_lines(EXAMPLE_BUNDLES)))
    0x1 LB: > { %v2 = vld [vmem:[#allocation2]]  ;; 1 more op }    <- the KV-block loop starts
    0x1 LB: > { %5 = dma.hbm_to_vmem [thread:$0]  %s1  ;; 1 more op }    <- DMA start
    0x2   : > { %v3 = vmatmul.bf16 %v2 }    <- matmul
    """
    bundles = parse_bundles(bundles_text)
    loop = kv_block_loop(bundles)
    if loop is None:
        raise ValueError("no KV-block loop in this listing (see bundles.COUNTING_RULE).")
    body = bundles[loop[0] : loop[1]]
    lines = [_line(body[0], 0, "the KV-block loop starts")]
    for what, pattern in PICKED:
        for bundle in body:
            ops = _ops(bundle)
            found = [i for i, op in enumerate(ops) if pattern.search(COMMENT.sub("", op))]
            if found:
                lines.append(_line(bundle, found[0], what))
                break
    return lines


def _ops(bundle) -> list[str]:
    """The ops of a bundle, as printed (comments kept), without the braces."""
    text = re.sub(r"\}\s*(/\*.*)?$", "", bundle.text.strip(), flags=re.S)
    return [op.strip() for op in text.lstrip("{").split(";;")]


def _line(bundle, i: int, what: str) -> str:
    """Bundle `bundle` as one line: its address, tag and depth, op i, the count of the rest."""
    op = _ops(bundle)[i]
    place = SOURCE_LOC.search(op)
    op = re.sub(r"\s*/\*[^*]*loc\(.*?\*/", "", op)  # the source location, shortened below
    if place:  # its file: a line number would move with every edit of the file
        op += f"  /* {short_path(place.group(1))} */"
    others = len(_ops(bundle)) - 1
    more = f"  ;; {others} more op{'s' * (others > 1)}" if others else ""
    tag = f"{bundle.tag}:" if bundle.tag else "  :"
    return f"{bundle.address:#x} {tag} {'>' * bundle.depth} {{ {op}{more} }}    <- {what}"


def kv_loop_listing(chip: str = "v5e") -> list[str]:
    """Our kernel (notebook 09's comparison case, 32 q rows per block) compiled for `chip`
    with libtpu, its listing picked by `pick_listing_lines`. Needs libtpu (no TPU), and
    libtpu not started yet in this process without the dump flags.

    >>> from minilib.tpu.compile import dump_here, tpu_compile_available
    >>> here = tpu_compile_available()[0] and dump_here()
    >>> lines = kv_loop_listing("v5e") if here else recorded_listing()  # needs libtpu
    >>> lines[0].rsplit("<- ", 1)[1]
    'the KV-block loop starts'
    """
    specs, fn = _our_kernel()
    return pick_listing_lines(_final_bundles(fn, specs, chip, "minilib_ragged_paged_attention."))


def _our_kernel():
    from minilib.tpu.kernel_costs import COMPARISON_CASE, rpa_function, rpa_specs

    specs = rpa_specs(**COMPARISON_CASE)
    fn = functools.partial(rpa_function("ours"), sm_scale=specs[0].shape[-1] ** -0.5, **CASE)
    return specs, fn


def _final_bundles(fn, specs, chip: str, kernel: str) -> str:
    """The `*-final_bundles.txt` of the kernel named `kernel...` in `fn`'s program, compiled
    as `minilib.tpu.compile.compile_here` compiles (whose report keeps figures, not text)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from minilib.tpu import dump_cache
    from minilib.tpu.compile import (
        abstract_mesh,
        default_layouts_assumed,
        dump_folder,
        require_libtpu,
        topology_device,
    )

    require_libtpu()
    folder = dump_folder()
    if folder is None:
        raise RuntimeError("libtpu started in this process without the dump flags: run "
                           f"`{COMMAND}` in a fresh process.")  # fmt: skip
    device = topology_device(chip)
    sharding = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
    structs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in specs]
    before = set(os.listdir(folder.path))
    try:
        with jax.sharding.use_abstract_mesh(abstract_mesh(device)):
            lowered = jax.jit(fn).lower(*structs)
        with default_layouts_assumed():
            _, new = dump_cache.compiled(chip, lowered, folder.path)
        mine = [n for n in new if f"-{kernel}" in n and n.endswith("-final_bundles.txt")]
        mine = [n for n in mine if "schedule-analysis" not in n]
        if not mine:
            raise RuntimeError(f"no final bundles of {kernel}* among libtpu's dump files")
        return (folder.path / mine[0]).read_text()
    finally:  # as compile_here does: each compile's dump is read once, then removed
        for name in set(os.listdir(folder.path)) - before:
            (folder.path / name).unlink(missing_ok=True)


def recorded_listing() -> list[str]:
    """The lines recorded for v5e (`RECORDED`), without its header of `#` lines.

    >>> any("dma.done.wait" in line for line in recorded_listing())
    True
    """
    text = RECORDED.read_text()
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def recorded_listing_label(not_here: str = "") -> str:
    """The label of the recorded lines (`labels.recorded_label`), read from `RECORDED`'s header.

    >>> print(recorded_listing_label())
    Recorded on ... with jax ..., libtpu ... by `python -m minilib.tpu.listing > ...`.
    """
    header = RECORDED.read_text().splitlines()[0]
    date, jax_version, libtpu = re.match(HEADER, header).groups()
    record = {"date": date, "jax": jax_version, "libtpu": libtpu}
    return recorded_label(record, COMMAND, not_here=not_here)


def _record() -> str:
    """The text of `RECORDED`: a header saying how it was made, then the lines."""
    import datetime

    import jax

    header = [
        f"# Recorded on {datetime.date.today().isoformat()} with jax {jax.__version__}, libtpu "
        f"{libtpu_version()}: our kernel's KV-block loop compiled for v5e, the lines of",
        "# minilib.tpu.listing.pick_listing_lines, on notebook 09's comparison case, 32 q rows"
        " per block.",
        f"# Made by: {COMMAND}",
    ]
    return "\n".join(header + kv_loop_listing("v5e")) + "\n"


if __name__ == "__main__":
    sys.stdout.write(_record())

"""The validation playground: each common mistake of `minilib.explore.mistakes`, run through the
real validator, with the code that made it and what the validator said.

    >>> ex = validation_playground("sliding_window=0 to turn it off")
    >>> "sliding_window=0 must be positive." in ex.text
    True
"""

from __future__ import annotations

import inspect
import textwrap

import numpy as np

from minilib.explore.explorer import Explorer, dropdown
from minilib.explore.mistakes import MISTAKES, SEQ_LENS, base_batch, run_mistake
from minilib.explore.text import pre

__all__ = ["validation_playground"]

ARG_NAMES = ("q", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")


def validation_playground(mistake: str = "12 q heads with 8 KV heads") -> Explorer:
    """Pick a common mistake: the playground builds a real batch with `make_batch`, breaks it
    as the mistake does, runs the real `dynamic_validate_inputs`, and shows the exact error
    with its hint, or that the inputs are valid.

    >>> ex = validation_playground("12 q heads with 8 KV heads")
    >>> print(*ex.text.splitlines()[:2], sep="\\n")
    RPAInputError
    num_q_heads=12 must be divisible by num_kv_heads=8
    """
    controls = {"mistake": dropdown("mistake", MISTAKES, mistake, width="520px")}
    return Explorer(
        "Validation playground: what the validators say",
        controls,
        _render_mistake,
        "Each choice runs the code shown through dynamic_validate_inputs.",
    )


def _render_mistake(values: dict):
    fn = MISTAKES[values["mistake"]]
    args, options = fn(base_batch())
    code = getattr(fn, "code", None) or textwrap.dedent(inspect.getsource(fn))
    shapes = "\n".join(
        f"{name:13s}: {_describe_array(a)}" for name, a in zip(ARG_NAMES, args, strict=True)
    )
    if options:
        shapes += "\noptions      : " + ", ".join(f"{k}={v!r}" for k, v in options.items())
    details = (
        "<b>The mistake</b> (b is a correct batch: make_batch(SEQ_LENS, num_q_heads=4, "
        f"num_kv_heads=2, head_dim=8, page_size=8), SEQ_LENS = {SEQ_LENS}):"
        + pre(code)
        + "<b>What reaches dynamic_validate_inputs(*args, **options)</b>:"
        + pre(shapes)
    )
    err = run_mistake(values["mistake"])  # the real validator on the same inputs
    if err is not None:
        return err, None, details
    return "Valid: dynamic_validate_inputs accepts these inputs.", None, details


def _describe_array(a) -> str:
    shape = getattr(a, "shape", None)
    if shape is None:
        return repr(a)
    value = f" = {np.asarray(a).tolist()}" if a.ndim <= 2 and a.size <= 16 else ""
    return f"{a.dtype}{list(shape)}{value}"

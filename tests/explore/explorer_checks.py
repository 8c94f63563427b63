"""What the explorer tests (test_explore_*.py, test_explorers.py) read an explorer with.

Each test sets control values, as a learner would, and reads what the explorer shows: text in
its HTML views, the figure as PNG bytes in its Image view. Errors must show the validators' own
messages, compared with what the validator raises when called directly.
"""

from __future__ import annotations

import pytest

PNG = b"\x89PNG"
# ipywidgets 7 (Colab's) makes its comms with a class that ipykernel has deprecated.
IPYWIDGETS_7_COMMS = "ignore:The `ipykernel.comm.Comm`:DeprecationWarning"


def shows_figure(ex) -> bool:
    figure = ex.views["figure"]
    return bytes(figure.value).startswith(PNG) and figure.layout.display != "none"


def shows_error(ex, err: Exception) -> bool:
    """The explorer shows exactly `str(err)`, and no figure."""
    return str(err) in ex.text and not shows_figure(ex)


def raised(fn, *args, **kwargs) -> Exception:
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return info.value

"""minilib.explore.playground: every mistake of the catalogue, shown with the validator's own
message (word for word, in the problem colour) and the code that made it."""

from __future__ import annotations

import pytest

widgets = pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from explorer_checks import IPYWIDGETS_7_COMMS, raised  # noqa: E402

from minilib.explore.explorer import OK_COLOUR, PROBLEM_COLOUR  # noqa: E402
from minilib.explore.mistakes import MISTAKES, base_batch  # noqa: E402
from minilib.explore.playground import validation_playground  # noqa: E402
from minilib.validation import dynamic_validate_inputs  # noqa: E402

pytestmark = pytest.mark.filterwarnings(IPYWIDGETS_7_COMMS)


def test_playground_offers_every_mistake_of_the_catalogue():
    # What each mistake makes the validators say is tested in test_validation.py.
    ex = validation_playground()
    assert list(ex.controls["mistake"].options) == list(MISTAKES)


# The valid batch, and a stale kv_len: wrong, but no check can see it (notebook 05).
PASSES = {"correct: a valid mixed batch", "a stale kv_len, which no check can catch"}


def test_playground_shows_each_validators_message_and_the_code():
    ex = validation_playground()
    for name in MISTAKES:
        ex.controls["mistake"].value = name
        args, options = MISTAKES[name](base_batch())
        err = raised(dynamic_validate_inputs, *args, **options) if name not in PASSES else None
        message = ex.views["message"].value
        if err is None:
            assert "Valid: dynamic_validate_inputs accepts these inputs." in ex.text
            assert OK_COLOUR in message and PROBLEM_COLOUR not in message
        else:
            assert str(err) in ex.text, name  # the message and its hint, word for word
            assert "Hint: " in ex.text
            # the error is the status, in the problem colour: no green "all clear" above it
            assert PROBLEM_COLOUR in message and OK_COLOUR not in message, name
        assert f"def {MISTAKES[name].__name__}(b):" in ex.text  # the code that ran

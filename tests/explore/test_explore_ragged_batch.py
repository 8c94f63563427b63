"""minilib.explore.ragged_batch: the figure of a ragged batch (packed q rows, each sequence's
causal mask), mask_numpy against the masking module's own mask, and the explorer, which shows
the validator's own messages."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

widgets = pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from explorer_checks import IPYWIDGETS_7_COMMS, raised, shows_error, shows_figure  # noqa: E402
from figure_checks import assert_reads_well, draw  # noqa: E402

from minilib.batch import make_batch  # noqa: E402
from minilib.errors import RPAInputError  # noqa: E402
from minilib.explore.ragged_batch import (  # noqa: E402
    MAX_MASKS,
    mask_numpy,
    ragged_batch_explorer,
    ragged_batch_figure,
)
from minilib.masking import causal_mask  # noqa: E402
from minilib.validation import dynamic_validate_inputs  # noqa: E402

pytestmark = pytest.mark.filterwarnings(IPYWIDGETS_7_COMMS)

# --- the figure ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seq_lens, window, padding",
    [
        ([(6, 6), (1, 20), (4, 12), (1, 9)], 5, None),
        ([(6, 6), (1, 20), (4, 12), (1, 9)], None, 16),
        ([(60, 60), (1, 200), (40, 120), (1, 9), (1, 3), (7, 7), (3, 30), (2, 2), (1, 1)], 8, 128),
        ([(0, 5), (1, 1)], None, None),
    ],
)
def test_ragged_batch_figure(seq_lens, window, padding):
    batch = make_batch(seq_lens, max_num_batched_tokens=padding)
    fig = draw(lambda: ragged_batch_figure(batch, window), f"ragged_{len(seq_lens)}_{window}")
    assert_reads_well(fig)
    assert len(fig.axes) == 1 + min(len(seq_lens), MAX_MASKS)


def test_mask_numpy_is_the_causal_mask():
    for q_len, kv_len in [(1, 9), (4, 12), (7, 7), (0, 3)]:
        for window in (None, 1, 3, 50):
            want = np.asarray(causal_mask(q_len, kv_len, window))
            np.testing.assert_array_equal(mask_numpy(q_len, kv_len, window), want)


def test_ragged_batch_figure_draws_the_reference_mask():
    batch = make_batch([(4, 12)])
    fig = ragged_batch_figure(batch, sliding_window=3)
    image = fig.axes[1].get_images()[0].get_array()
    # 0 may attend, 1 a future key, 2 a key older than the window.
    assert ((image == 0) == ~np.asarray(causal_mask(4, 12, 3))).all()
    assert (image[0, :6] == 2).all() and (image[0, 9:] == 1).all()


# --- the explorer --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ragged():
    return ragged_batch_explorer(q_lens="6, 1, 4, 1", kv_lens="6, 20, 12, 9")


def test_ragged_batch_shows_its_arrays(ragged):
    assert shows_figure(ragged)
    text = ragged.text
    assert "cu_q_lens = [0, 6, 7, 11, 12]" in text and "kv_lens   = [6, 20, 12, 9]" in text
    assert "1 prefill, 2 decode, 1 chunk" in text
    assert "[7, 11)" in text  # the packed q rows of the chunk


def test_ragged_batch_sliding_window(ragged):
    ragged.controls["sliding_window"].value = "4"
    assert shows_figure(ragged) and "sliding_window=4" in ragged.text
    assert "keys 16..19" in ragged.text  # the decode at position 19 sees its last 4 keys
    ragged.controls["sliding_window"].value = "0"
    batch = make_batch([(6, 6), (1, 20), (4, 12), (1, 9)])
    err = raised(dynamic_validate_inputs, *batch.args(), sliding_window=0)
    assert err.message == "sliding_window=0 must be positive."
    assert shows_error(ragged, err)
    ragged.controls["sliding_window"].value = "four"
    assert "'four' is not a whole number" in ragged.text
    ragged.controls["sliding_window"].value = "99999999999999999999"  # the options' own check
    err = raised(dynamic_validate_inputs, *batch.args(), sliding_window=10**20 - 1)
    assert "is too large" in err.message and shows_error(ragged, err)
    ragged.controls["sliding_window"].value = ""
    assert shows_figure(ragged) and "no sliding window" in ragged.text


def test_ragged_batch_bad_lengths(ragged):
    ragged.controls["q_lens"].value = "6, 21, 4, 1"  # q_len > kv_len: the validator says so
    batch = make_batch([(6, 6), (21, 21), (4, 12), (1, 9)])
    stale = dataclasses.replace(batch, kv_lens=batch.kv_lens.at[1].set(20))
    err = raised(dynamic_validate_inputs, *stale.args())
    assert isinstance(err, RPAInputError) and shows_error(ragged, err)
    assert err.message == "q_len=21 must be less or equal to kv_len=20 at sequence 1."
    ragged.controls["q_lens"].value = "6, 1, 4, -1"  # a negative length: make_batch says so
    err = raised(make_batch, [(6, 6), (1, 20), (4, 12), (-1, 9)])
    assert isinstance(err, RPAInputError) and shows_error(ragged, err)
    ragged.controls["q_lens"].value = "6, 1, 4, 1"
    ragged.controls["kv_lens"].value = "6, 20, -3, 9"  # a negative kv_len: the validator
    stale = dataclasses.replace(batch, kv_lens=batch.kv_lens.at[2].set(-3))
    err = raised(dynamic_validate_inputs, *stale.args())
    assert err.message == "kv_lens[2]=-3 must be non-negative." and shows_error(ragged, err)
    ragged.controls["kv_lens"].value = "6, 20, 12, 9"
    ragged.controls["q_lens"].value = "6, 1, 4"
    assert "len(q_lens)=3 but len(kv_lens)=4" in ragged.text
    ragged.controls["q_lens"].value = "6, x, 4, 1"
    assert "'x' (entry 1) is not a whole number" in ragged.text
    ragged.controls["q_lens"].value = "6, 1, 4, 1"
    assert shows_figure(ragged)


def test_ragged_batch_counts_read_in_the_singular_too():
    ex = ragged_batch_explorer(q_lens="1", kv_lens="5")
    assert "Valid: 1 sequence (1 decode), 1 q row; no sliding window." in ex.text

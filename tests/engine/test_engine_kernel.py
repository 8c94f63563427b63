"""The engine attends with minilib's kernel: by default on a TPU, when asked elsewhere (TPU
interpret mode), and `python -m minilib doctor --tpu`'s engine check, exact against the dense
model, which fails when the kernel is wrong."""

from __future__ import annotations

import jax
import numpy as np

import minilib
import minilib.kernel
from minilib import doctor
from minilib.engine import Engine, ModelConfig, init_params
from minilib.engine import engine as engine_module
from minilib.engine.engine import default_attention

CONFIG = ModelConfig(vocab_size=64, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16)
ULPS = 8  # float32 rounding allowed in a later layer's cache: units in the last place


def test_the_default_attention_is_the_kernel_on_a_tpu_and_jnp_elsewhere(monkeypatch):
    eng = Engine(init_params(CONFIG), CONFIG, num_pages=4, page_size=4,
                 max_num_batched_tokens=8, max_num_seqs=2)  # fmt: skip
    assert eng.attention is default_attention()
    if jax.default_backend() != "tpu":
        assert eng.attention is minilib.ragged_paged_attention_jnp
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert default_attention() is minilib.ragged_paged_attention


def test_the_doctors_engine_check_runs_the_kernel_exact_against_dense(capsys):
    assert doctor.engine_check() == ("engine", True)
    out = capsys.readouterr().out
    assert "through minilib's kernel" in out and "PASS  engine == dense" in out


def test_the_doctors_engine_check_fails_a_wrong_kernel(monkeypatch, capsys):
    kernel = minilib.kernel.ragged_paged_attention

    def forgets_the_cache(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
        q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
        return kernel(q, kv_pages, q_lens, page_indices, cu_q_lens, num_seqs, **options)

    monkeypatch.setattr(minilib.kernel, "ragged_paged_attention", forgets_the_cache)
    assert doctor.engine_check() == ("engine", False)
    assert "FAIL  engine == dense" in capsys.readouterr().out


def test_an_engine_run_through_the_kernel_matches_one_through_jnp():
    """Speculative decoding's verification rows and padding buckets through the kernel (a
    proposer that always drafts, so that every decode verifies two drafts)."""
    params = init_params(CONFIG)
    prompts = [[1, 2, 3, 4, 1, 2, 3], [9, 8, 7]]
    sizes = {"num_pages": 8, "page_size": 4, "max_num_batched_tokens": 8, "max_num_seqs": 2,
             "num_speculative_tokens": 2, "token_buckets": [4, 8], "seq_buckets": [2]}  # fmt: skip
    jnp_engine = Engine(params, CONFIG, **sizes)
    kernel_engine = Engine(params, CONFIG, attention=minilib.ragged_paged_attention, **sizes)
    for eng in (jnp_engine, kernel_engine):
        eng.scheduler.propose_drafts = lambda token_ids: token_ids[-2:]
    assert kernel_engine.generate(prompts, 5) == jnp_engine.generate(prompts, 5)
    assert sum(s.num_draft_tokens for s in kernel_engine.stats) > 0


def test_the_kernel_writes_the_new_tokens_in_place_of_the_scatter(monkeypatch):
    """Through the kernel the engine passes the new K/V to it (`new_keys`, `new_values`) and
    never calls the scatter; the cache it ends with is the jnp engine's, byte for byte, NaN in
    the slots never written. Byte for byte because this model has one layer, whose K/V come
    from the embeddings alone; a later layer's differ by rounding (the next test)."""
    params = init_params(CONFIG)
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7]]
    sizes = {"num_pages": 8, "page_size": 4, "max_num_batched_tokens": 8, "max_num_seqs": 2}
    jnp_engine = Engine(params, CONFIG, **sizes)
    kernel_engine = Engine(params, CONFIG, attention=minilib.ragged_paged_attention, **sizes)
    assert kernel_engine.kernel_writes_kv and not jnp_engine.kernel_writes_kv
    want = jnp_engine.generate(prompts, 4)

    def no_scatter(*args):
        raise AssertionError("the kernel engine called the separate scatter")

    monkeypatch.setattr(engine_module, "write_tokens", no_scatter)
    assert kernel_engine.generate(prompts, 4) == want
    got, expected = (np.asarray(e.kv_pages[0]) for e in (kernel_engine, jnp_engine))
    assert np.isnan(expected).any(), "every slot written: the NaN check would be empty"
    np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))


def test_through_the_kernel_layer_0s_cache_is_equal_and_later_layers_within_rounding():
    """What holds per layer, kernel engine against jnp engine. Layer 0's K/V are projections
    of the embeddings, the same program either way: bitwise equal. Layer l > 0's K/V are
    projections of layer l - 1's attention output, which the kernel and the jnp version sum
    in different orders: they differ in the last bits (about 1e-6 on values up to 4 here),
    so they are held to float32 rounding, `ULPS` units in the last place of the layer's
    largest value, and not required equal. The slots never written are NaN in both."""
    config = ModelConfig(vocab_size=64, num_layers=3, num_q_heads=2, num_kv_heads=1, head_dim=16)
    params = init_params(config)
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7]]
    sizes = {"num_pages": 8, "page_size": 4, "max_num_batched_tokens": 8, "max_num_seqs": 2}
    jnp_engine = Engine(params, config, **sizes)
    kernel_engine = Engine(params, config, attention=minilib.ragged_paged_attention, **sizes)
    assert kernel_engine.generate(prompts, 4) == jnp_engine.generate(prompts, 4)
    got, want = (np.asarray(kernel_engine.kv_pages[0]), np.asarray(jnp_engine.kv_pages[0]))
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    for layer in range(1, config.num_layers):
        got = np.asarray(kernel_engine.kv_pages[layer])
        want = np.asarray(jnp_engine.kv_pages[layer])
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        written = ~np.isnan(want)
        tolerance = ULPS * np.finfo(np.float32).eps * np.abs(want[written]).max()
        np.testing.assert_allclose(got[written], want[written], rtol=0, atol=tolerance)

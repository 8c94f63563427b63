"""The decode rungs' usual mistakes, each as a function that makes it.

Rungs 2 to 5 of the ladder compute paged decode attention page by page: for each sequence, the
online softmax over its pages, each page found through `page_indices`. `paged_decode_numpy`
does the same in NumPy, and its keywords make the mistakes a learner makes in a kernel: pages
taken by position instead of through the page table, the wrong row or column of the table,
key positions counted from 0 on every page, the softmax state reset too often, the output
written after the first page. `decode_mistakes()` names each of them in the words a report
uses.

A checker of a rung (`minilib.exercises.ex08_ladder`) compares a wrong output with each of
these; the first that matches is its likely cause. When none matches, `_locate` says which
sequences differ, and `_pattern` what the wrong rows say (never written? only some q heads?
only the sequences of several pages?).
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from minilib.exercises.checking import SM_SCALE_IGNORED, Case
from minilib.kv_cache import pages_needed
from minilib.ladder.scalar_prefetch import paged_decode_reference
from minilib.options import DEFAULT_MASK_VALUE
from minilib.tpu.numerics import BF16_PASS_TOLERANCE, one_bf16_pass

__all__ = ["decode_mistakes", "paged_decode_numpy"]


@np.errstate(invalid="ignore", divide="ignore", over="ignore")  # NaN pages: NaN, silently
def paged_decode_numpy(
    q,  # [num_seqs, num_q_heads, head_dim], one row per sequence slot
    kv_pages,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    kv_lens,  # i32[num_seqs]
    page_indices,  # i32[num_seqs, pages_per_seq]
    *,
    sm_scale,
    page_of=None,
    first_pos=None,
    reset_each_page=False,
    reset_each_grid_step=False,
    stop_after_first=False,
    alpha_upside_down=False,
    max_before_mask=False,
    mask_added=False,
    visible_shift=0,
):  # -> f64[num_seqs, num_q_heads, head_dim]; 0 for a sequence with no key
    """Decode attention page by page, as the kernels do it, in NumPy: the online softmax over
    the pages of each sequence. The keywords make the kernels' usual mistakes:

      page_of(seq, i)        the page that page i of sequence seq is read from
                             (right: page_indices[seq, i])
      first_pos(i)           the position of page i's first key (right: i * page_size)
      reset_each_page        the softmax state initialised on every page
      reset_each_grid_step   ... on every grid step (rungs 2 and 3: one step per page slot)
      stop_after_first       the output written after the first page
      alpha_upside_down      alpha = exp(m_next - m_prev), not exp(m_prev - m_next)
      max_before_mask        the running max taken over the scores before the mask
      mask_added             the mask added to the scores (a bias), not selected
      visible_shift          the keys at positions < kv_len + visible_shift seen (right: 0;
                             1: `k_pos <= kv_len`, -1: `k_pos < kv_len - 1`), a hidden score
                             set to the kernels' finite mask value, V zeroed past kv_len

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(1, 5), (1, 12)], num_q_heads=2, num_kv_heads=1, head_dim=8,
    ...                page_size=4)
    >>> args = (b.q, b.kv_pages, b.kv_lens, b.page_indices)
    >>> right = paged_decode_reference(*args, sm_scale=0.3)
    >>> bool(np.allclose(paged_decode_numpy(*args, sm_scale=0.3), right, atol=1e-5))
    True
    >>> wrong = paged_decode_numpy(*args, sm_scale=0.3, stop_after_first=True)
    >>> bool(np.allclose(wrong, right, atol=1e-5))   # both sequences have a second page
    False
    """
    q, kv = np.asarray(q, np.float64), np.asarray(kv_pages, np.float64)
    table, lens = np.asarray(page_indices), np.asarray(kv_lens)
    num_seqs, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = kv.shape[1], kv.shape[2] // 2
    group = num_q_heads // num_kv_heads
    page_of = page_of or (lambda seq, i: table[seq, i])
    first_pos = first_pos or (lambda i: i * page_size)
    heads = [r // group for r in range(num_q_heads)]  # the KV head of each q head
    out = np.zeros_like(q)
    for seq in range(num_seqs):
        kv_len = int(lens[seq])
        m = np.full(num_q_heads, -np.inf)
        l, acc = np.zeros(num_q_heads), np.zeros((num_q_heads, head_dim))
        num_pages = pages_needed(kv_len, page_size)
        if reset_each_grid_step and num_pages < table.shape[1]:
            continue  # the last grid step, past the last page, reset it all: output 0
        for i in range(num_pages):
            if reset_each_page or reset_each_grid_step:
                m, l, acc = np.full(num_q_heads, -np.inf), l * 0, acc * 0
            page = kv[int(page_of(seq, i)) % kv.shape[0]]
            pos = first_pos(i) + np.arange(page_size)
            keys = page[:, 0::2][:, heads]  # [tokens, num_q_heads, head_dim]
            vals = np.where((pos < kv_len)[:, None, None], page[:, 1::2][:, heads], 0)
            s = np.einsum("hd,thd->ht", q[seq], keys) * sm_scale
            s_max = s.max(axis=1)  # before the mask: the keys past kv_len too
            if mask_added:  # NaN + -inf is NaN: a NaN key past kv_len stays NaN
                s = s + np.where(pos[None, :] < kv_len, 0, -np.inf)
            elif visible_shift:  # a page with no key seen: its finite scores weigh alike
                s = np.where(pos[None, :] < kv_len + visible_shift, s, DEFAULT_MASK_VALUE)
            else:
                s = np.where(pos[None, :] < kv_len, s, -np.inf)
            m_next = np.maximum(m, s_max if max_before_mask else s.max(axis=1))
            p = np.exp(s - m_next[:, None])
            alpha = np.exp(m_next - m) if alpha_upside_down else np.exp(m - m_next)
            l = alpha * l + p.sum(axis=1)
            acc = alpha[:, None] * acc + np.einsum("ht,thd->hd", p, vals)
            m = m_next
            if stop_after_first:
                break
        out[seq] = acc / np.where(l == 0, 1, l)[:, None]  # l = 0: no key, acc = 0: output 0
    return out


def decode_mistakes() -> dict[str, Callable]:
    """The usual mistakes of the decode rungs: explanation -> a function that makes it, with
    the arguments of `paged_decode_reference`.

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(1, 9)], num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=4)
    >>> args = (b.q, b.kv_pages, b.kv_lens, b.page_indices)
    >>> mistakes = decode_mistakes()
    >>> no_sm_scale = mistakes["sm_scale is not applied to the scores."]
    >>> right = paged_decode_reference(*args, sm_scale=0.3)
    >>> bool(np.allclose(no_sm_scale(*args, sm_scale=0.3), right, atol=1e-5))
    False
    >>> print(list(mistakes)[1])
    the page table is not used: page i of sequence seq is kv_pages[page_indices[seq, i]], not
    kv_pages[i].
    """

    def k_v_halves(q, kv_pages, kv_lens, page_indices, *, sm_scale):
        # K as the first half of the combined heads, V as the second: not interleaved.
        num_kv_heads = kv_pages.shape[2] // 2
        halves = jnp.concatenate([kv_pages[:, :, :num_kv_heads], kv_pages[:, :, num_kv_heads:]])
        interleaved = jnp.stack([halves[: len(kv_pages)], halves[len(kv_pages) :]], axis=3)
        kv = interleaved.reshape(kv_pages.shape)
        return paged_decode_reference(q, kv, kv_lens, page_indices, sm_scale=sm_scale)

    def pages_by_position(*args, sm_scale):
        return paged_decode_numpy(*args, sm_scale=sm_scale, page_of=lambda seq, i: i)

    def first_page_of_the_table(*args, sm_scale):
        table = np.asarray(args[3])
        return paged_decode_numpy(*args, sm_scale=sm_scale, page_of=lambda seq, i: table[0, i])

    def always_page_zero(*args, sm_scale):
        table = np.asarray(args[3])
        return paged_decode_numpy(*args, sm_scale=sm_scale, page_of=lambda seq, i: table[seq, 0])

    def positions_from_zero(*args, sm_scale):
        return paged_decode_numpy(*args, sm_scale=sm_scale, first_pos=lambda i: 0)

    def reset_each_page(*args, sm_scale):
        return paged_decode_numpy(*args, sm_scale=sm_scale, reset_each_page=True)

    def reset_each_grid_step(*args, sm_scale):  # rungs 2 and 3: one grid step per page slot
        return paged_decode_numpy(*args, sm_scale=sm_scale, reset_each_grid_step=True)

    def first_page_only(*args, sm_scale):
        return paged_decode_numpy(*args, sm_scale=sm_scale, stop_after_first=True)

    def no_sm_scale(*args, sm_scale):
        return paged_decode_numpy(*args, sm_scale=1.0)

    def head_dim_scale(*args, sm_scale):  # 1/sqrt(head_dim), whatever sm_scale says
        return paged_decode_numpy(*args, sm_scale=float(args[0].shape[-1]) ** -0.5)

    def alpha_upside_down(*args, sm_scale):
        return paged_decode_numpy(*args, sm_scale=sm_scale, alpha_upside_down=True)

    def max_before_mask(*args, sm_scale):
        return paged_decode_numpy(*args, sm_scale=sm_scale, max_before_mask=True)

    def mask_added(*args, sm_scale):
        return paged_decode_numpy(*args, sm_scale=sm_scale, mask_added=True)

    def one_key_past(*args, sm_scale):
        return paged_decode_numpy(*args, sm_scale=sm_scale, visible_shift=1)

    def last_key_hidden(*args, sm_scale):
        return paged_decode_numpy(*args, sm_scale=sm_scale, visible_shift=-1)

    return {
        "K and V are interleaved on the combined head axis: K of KV head h is slot 2h, V is "
        "slot 2h + 1 (not the first and second halves).": k_v_halves,
        "the page table is not used: page i of sequence seq is kv_pages[page_indices[seq, i]], "
        "not kv_pages[i].": pages_by_position,
        "every sequence reads sequence 0's row of the page table: the row is "
        "page_indices[seq].": first_page_of_the_table,
        "every step reads the sequence's first page: page i is page_indices[seq, i], not "
        "page_indices[seq, 0].": always_page_zero,
        "the keys of page i sit at positions i * page_size ... (i + 1) * page_size - 1 "
        "(`first_pos`), not 0 ... page_size - 1.": positions_from_zero,
        "the softmax state is initialised on every page: only on the first (`i == 0`, or "
        "before the page loop); m, l and acc carry the earlier pages.": reset_each_page,
        "the softmax state is initialised on every grid step: only on the first page "
        "(`pl.when(i == 0)`); m, l and acc carry the earlier pages.": reset_each_grid_step,
        "only the first page counts: the output was written, or the loop stopped, after page "
        "0; write `acc / l` after the last page.": first_page_only,
        "sm_scale is not applied to the scores.": no_sm_scale,
        SM_SCALE_IGNORED: head_dim_scale,
        "alpha is upside down: alpha = exp(m_prev - m_next), at most 1. exp(m_next - m_prev) "
        "is inf on the first page, where m_prev = -inf, and inf * 0 = NaN.": alpha_upside_down,
        "the running max was taken before the mask: the scores of the keys past kv_len (NaN "
        "here, garbage on a chip) then set m. Mask first (`jnp.where(k_pos < kv_len, s, "
        "mask_value)`), then take the max.": max_before_mask,
        "the mask is added to the scores (`s + jnp.where(k_pos < kv_len, 0, mask_value)`, a "
        "bias, as JAX's reference does) rather than selected: the scores of the keys past "
        "kv_len are NaN here (garbage on a chip), and NaN + mask_value is still NaN. Select "
        "instead: `jnp.where(k_pos < kv_len, s, mask_value)` drops a masked score whatever it "
        "holds.": mask_added,
        "the length mask is one key too wide: the token sees the key at position kv_len, "
        "past its sequence (NaN here, garbage on a chip). It sees k_pos < kv_len (`<`, not "
        "`<=`).": one_key_past,
        "the length mask hides the token's own key: the new token sits at position kv_len - 1 "
        "and sees every key up to its own, k_pos < kv_len (not kv_len - 1). A sequence of one "
        "token then sees no key at all.": last_key_hidden,
    }


# --- naming what went wrong, where no mistake matches ---------------------------------------------


def _sequence_kind(seq: int, kv_len: int, page_size: int, pages_per_seq: int, last: bool):
    pages = pages_needed(kv_len, page_size)
    if kv_len == 0:
        return "kv_len=0, an empty slot: no page at all"
    if kv_len == 1:
        return "kv_len=1, one token"
    notes = []
    if kv_len % page_size == 0:
        notes.append(f"{pages} whole pages" + ("" if last else ", not the last sequence"))
    if pages == pages_per_seq:
        notes.append(f"uses all {pages_per_seq} page slots")
    return f"kv_len={kv_len}" + (f" ({'; '.join(notes)})" if notes else "")


def _describe_sequences(case: Case) -> list[str]:
    _, kv_pages, kv_lens, page_indices = case.args
    page_size, pages_per_seq = kv_pages.shape[1], page_indices.shape[1]
    lens = [int(n) for n in np.asarray(kv_lens)]
    return [
        _sequence_kind(s, n, page_size, pages_per_seq, s == len(lens) - 1)
        for s, n in enumerate(lens)
    ]


def _locate(expected, got, case: Case) -> str:
    """Which sequences differ, each with what is special about it."""
    want = np.asarray(expected, np.float64)
    try:
        have = np.asarray(got, np.float64).reshape(want.shape)
    except Exception:
        return ""
    tol = BF16_PASS_TOLERANCE if one_bf16_pass() else 1e-3  # a TPU's matmuls: one bf16 pass
    bad = ~np.isclose(have, want, atol=tol, rtol=tol, equal_nan=True)
    wrong = [s for s in range(want.shape[0]) if bad[s].any()]
    if not wrong:
        return ""
    kinds = _describe_sequences(case)
    listed = "; ".join(f"{s} ({kinds[s]})" for s in wrong)
    right = len(kinds) - len(wrong)
    return f"sequences that differ: {listed}. The other {right} are right."


def _pattern(expected, got, case: Case) -> str | None:
    """What the wrong rows of the output say, when no usual mistake matches: which sequences
    (never written? only those with several pages? only those ending in a partial page?)
    and which q heads are wrong."""
    want = np.asarray(expected, np.float64)
    try:
        have = np.asarray(got, np.float64).reshape(want.shape)
    except Exception:
        return None
    _, kv_pages, kv_lens, _ = case.args
    page_size, num_kv_heads = kv_pages.shape[1], kv_pages.shape[2] // 2
    lens = [int(n) for n in np.asarray(kv_lens)]
    tol = BF16_PASS_TOLERANCE if one_bf16_pass() else 1e-3
    bad = ~np.isclose(have, want, atol=tol, rtol=tol, equal_nan=True)  # [seq, head, dim]
    wrong = [s for s in range(len(lens)) if bad[s].any()]
    if not wrong:
        return None
    listed = ", ".join(str(s) for s in wrong)

    def copied(s):  # the output of another sequence: what the buffer held before
        return any(np.allclose(have[s], x[t], atol=tol) for x in (have, want)
                   for t in range(len(lens)) if t != s)  # fmt: skip

    # Never written: each wrong row holds another sequence's output, or NaN (the buffer's
    # first contents), and at least one holds another's (NaN alone has other causes).
    never = [copied(s) or np.isnan(have[s]).all() for s in wrong]
    if all(never) and any(copied(s) for s in wrong):
        empty = all(lens[s] == 0 for s in wrong)
        return (
            f"the output of sequence{'s' * (len(wrong) > 1)} {listed} was never written: it "
            "holds NaN or another sequence's output, what its buffer held before. Write the "
            "output of every sequence, on its last grid step (`i == pl.num_programs(1) - 1`, "
            "not the sequence's last page), "
            + ("an empty slot's too: kv_len 0 has no page, l = 0 and acc = 0, and its output "
               "is 0." if empty else "kv_len 0 included (its output is 0).")
        )  # fmt: skip
    heads = sorted({int(h) for h in np.argwhere(bad[wrong].any(axis=-1))[:, 1]})
    if len(heads) < want.shape[1]:
        group = want.shape[1] // num_kv_heads
        return (
            f"only q heads {', '.join(map(str, heads))} of {want.shape[1]} differ: how q heads "
            f"share the {num_kv_heads} KV heads. q head h reads KV head h // group (group = "
            f"{group}), whose K is the combined slot 2 * (h // group) and V the slot after it."
        )
    pages = [pages_needed(n, page_size) for n in lens]
    if all(pages[s] > 1 for s in wrong):
        return (
            f"only sequences with more than one page differ ({listed}): what carries from one "
            "page to the next. m, l and acc are initialised on page 0 only, alpha = "
            "exp(m_prev - m_next) rescales l and acc, and page i holds the keys at positions "
            "i * page_size and on."
        )
    if all(lens[s] % page_size for s in wrong):
        return (
            f"only sequences whose last page is partial differ ({listed}): the keys past "
            "kv_len. Mask the scores at positions >= kv_len, and zero those rows of V."
        )
    return None


def _page_namer(case: Case) -> Callable[[int], str]:
    _, kv_pages, kv_lens, page_indices = case.args
    page_size, total = kv_pages.shape[1], kv_pages.shape[0]
    table, lens = np.asarray(page_indices), [int(n) for n in np.asarray(kv_lens)]

    def name(page: int) -> str:
        for seq, n in enumerate(lens):
            used = pages_needed(n, page_size)
            for i, p in enumerate(table[seq].tolist()):
                if p == page and i < used:
                    return f"page {i} of sequence {seq} (kv_pages[{page}])"
        for seq, n in enumerate(lens):
            for i, p in enumerate(table[seq].tolist()):
                if p == page:
                    return (
                        f"kv_pages[{page}], through page_indices[{seq}, {i}], which is past "
                        f"sequence {seq}'s pages ({_sequence_kind(seq, n, page_size, 0, False)}) "
                        "and holds garbage"
                    )
        if not 0 <= page < total:
            return f"kv_pages[{page}], which does not exist ({total} pages)"
        return f"kv_pages[{page}], a page no sequence owns"

    return name

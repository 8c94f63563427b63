"""Self-checking exercises for the course notebooks.

Each notebook ends with exercises: a function for you to fill in (its body raises
`NotImplementedError("FILL ME IN")`) and a checker that runs it against minilib's tested
version on cases the notebook never showed:

    >>> from minilib.exercises import check_live_seq_lens
    >>> def live_seq_lens(kv_lens, cu_q_lens, num_seqs):
    ...     raise NotImplementedError("FILL ME IN")
    >>> result = check_live_seq_lens(live_seq_lens)
    Not attempted yet: live_seq_lens raises NotImplementedError. Fill it in, then run this ...
    >>> result.status
    'not attempted'

A checker prints "Passed", "Not attempted yet", or "FAILED" with the case, the output that
differs, expected versus got, and, when your output matches a common mistake, its likely cause.
It never raises. It returns a `CheckResult`: truthy only when every case passed, with
`.status` ("passed", "failed", "not attempted") and `.report` (the printed text). A failure
keeps its case, `.case` (`.case.inputs()`: the arrays your function was given), and
`.rerun()` runs your function and the reference on it again: both outputs, and where they
differ most.

Every checker takes `fn` and two keywords: `seed` (another set of random cases) and `verbose`
(False: print nothing, just return the result). Worked solutions are in the repository's
`solutions/` folder; try first.
"""

from minilib.exercises.checking import CheckResult
from minilib.exercises.ex00_tour import check_live_seq_lens
from minilib.exercises.ex01_heads import check_grouped_query_attention, check_repeat_kv_pages
from minilib.exercises.ex02_paged_cache import check_gather_kv, check_write_new_tokens
from minilib.exercises.ex03_ragged import check_causal_mask, check_seq_for_row
from minilib.exercises.ex04_reference import check_attend_soft_cap, check_sliding_window_mask
from minilib.exercises.ex05_validation import check_validate_page_indices
from minilib.exercises.ex06_online_softmax import check_online_softmax_update
from minilib.exercises.ex06_vectorized import check_decode_attention
from minilib.exercises.ex07_flash import check_flash_attention
from minilib.exercises.ex07_flash_call import check_flash_pallas_call
from minilib.exercises.ex07_pallas import check_softmax_kernel
from minilib.exercises.ex08_kernel import check_kv_blocks_to_visit
from minilib.exercises.ex08_ladder import (
    check_double_buffered_decode,
    check_paged_decode_async_copy,
    check_paged_decode_attention,
    check_prefetching_decode,
)
from minilib.exercises.ex08_next_work import check_next_work
from minilib.exercises.ex08_ragged import check_prefill_chunk, check_ragged_paged_attention
from minilib.exercises.ex09_performance import (
    check_arithmetic_intensity,
    check_num_kv_pages_per_block,
)
from minilib.exercises.ex10_engine import (
    check_cache_full_pages,
    check_can_admit,
    check_preempt,
)
from minilib.exercises.ex10_rejection import check_verify_drafts

__all__ = [
    "CheckResult",
    "check_arithmetic_intensity",
    "check_attend_soft_cap",
    "check_cache_full_pages",
    "check_can_admit",
    "check_causal_mask",
    "check_decode_attention",
    "check_double_buffered_decode",
    "check_flash_attention",
    "check_flash_pallas_call",
    "check_gather_kv",
    "check_grouped_query_attention",
    "check_kv_blocks_to_visit",
    "check_live_seq_lens",
    "check_next_work",
    "check_num_kv_pages_per_block",
    "check_online_softmax_update",
    "check_paged_decode_async_copy",
    "check_paged_decode_attention",
    "check_preempt",
    "check_prefetching_decode",
    "check_prefill_chunk",
    "check_ragged_paged_attention",
    "check_repeat_kv_pages",
    "check_seq_for_row",
    "check_sliding_window_mask",
    "check_softmax_kernel",
    "check_validate_page_indices",
    "check_verify_drafts",
    "check_write_new_tokens",
]

"""Self-checking exercises for the course notebooks.

Each notebook ends with exercises: a function for you to fill in (its body raises
`NotImplementedError("FILL ME IN")`) and a checker that runs it against minilib's tested
version on cases the notebook never showed:

    >>> from minilib.exercises import check_pages_needed
    >>> def pages_needed(kv_len, page_size):
    ...     raise NotImplementedError("FILL ME IN")
    >>> result = check_pages_needed(pages_needed)
    Not attempted yet: pages_needed raises NotImplementedError. Fill it in, then run this ...
    >>> result.status
    'not attempted'

A checker prints "Passed", "Not attempted yet", or "FAILED" with the case, the output that
differs, expected versus got, and, when your output matches a common mistake, its likely cause.
It never raises. It returns a `CheckResult`: truthy only when every case passed, with
`.status` ("passed", "failed", "not attempted") and `.report` (the printed text).

Every checker takes `fn` and two keywords: `seed` (another set of random cases) and `verbose`
(False: print nothing, just return the result). Worked solutions are in the repository's
`solutions/` folder; try first.
"""

from minilib.exercises.checking import CheckResult
from minilib.exercises.ex00_tour import check_pages_needed
from minilib.exercises.ex01_heads import check_kv_head_for_q_head, check_repeat_kv
from minilib.exercises.ex02_paged_cache import check_gather_kv, check_token_location
from minilib.exercises.ex03_ragged import check_causal_mask, check_seq_for_row
from minilib.exercises.ex04_reference import check_attend_soft_cap, check_sliding_window_mask
from minilib.exercises.ex05_validation import check_validate_q_lens
from minilib.exercises.ex06_online_softmax import check_online_softmax_update
from minilib.exercises.ex07_pallas import check_softmax_kernel
from minilib.exercises.ex08_kernel import check_kv_blocks_to_visit
from minilib.exercises.ex09_performance import check_decode_kv_bytes
from minilib.exercises.ex10_engine import check_can_admit, check_preempt

__all__ = [
    "CheckResult",
    "check_attend_soft_cap",
    "check_can_admit",
    "check_causal_mask",
    "check_decode_kv_bytes",
    "check_gather_kv",
    "check_kv_blocks_to_visit",
    "check_kv_head_for_q_head",
    "check_online_softmax_update",
    "check_pages_needed",
    "check_preempt",
    "check_repeat_kv",
    "check_seq_for_row",
    "check_sliding_window_mask",
    "check_softmax_kernel",
    "check_token_location",
    "check_validate_q_lens",
]

"""Solutions to notebook 10 (the serving engine)."""


def can_admit(
    num_prompt_tokens, *, token_budget_left, num_free_pages, page_size, num_running, max_num_seqs
):
    # Only the first chunk runs this step, so only its pages are needed now.
    first_chunk = min(num_prompt_tokens, token_budget_left)
    pages_for_first_chunk = -(-first_chunk // page_size)
    return (
        num_running < max_num_seqs
        and token_budget_left > 0
        and pages_for_first_chunk <= num_free_pages
    )


def preempt(request, allocator):
    allocator.free(request.pages)  # the pages go back to the pool ...
    request.pages = []  # ... and are no longer this request's
    request.num_computed = 0  # their K/V is gone: recompute prompt + output when readmitted
    # request.output stays: those tokens are recomputed in one prefill, not generated again

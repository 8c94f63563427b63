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
    # request.output stays: those tokens are recomputed as prefill, not generated again


def cache_full_pages(request, pool, page_size):
    from minilib.engine.prefix_cache import hash_block_tokens

    # Pages before len(request.cached_hashes) are named already. A page is full when all its
    # tokens' K/V is computed: num_computed, not len(request.tokens).
    for i in range(len(request.cached_hashes), request.num_computed // page_size):
        parent = request.cached_hashes[-1] if request.cached_hashes else None  # chained
        block_hash = hash_block_tokens(parent, request.tokens[i * page_size : (i + 1) * page_size])
        pool.cache_page(request.pages[i], block_hash)  # no reference taken: counted once
        request.cached_hashes.append(block_hash)


def verify_drafts(probs, drafts, uniforms, sample):
    import numpy as np

    probs = np.asarray(probs)
    tokens = []
    for i, draft in enumerate(drafts):
        draft = int(draft)
        if uniforms[i] < probs[i, draft]:  # kept with probability p_i(x_i): q = 1
            tokens.append(draft)
            continue
        # Rejected: a draw from p_i without the draft (max(p - q, 0), renormalised), and
        # nothing after it: the later drafts guessed on from the rejected one.
        residual = np.array(probs[i], dtype=np.float64)
        residual[draft] = 0.0
        tokens.append(sample(residual / residual.sum()))
        return tokens
    tokens.append(sample(probs[len(drafts)]))  # every draft kept: the bonus token, last row
    return tokens

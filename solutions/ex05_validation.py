"""Solutions to notebook 05 (validation)."""

import numpy as np

from minilib import RPAInputError


def validate_page_indices(kv_pages, kv_lens, page_indices, num_seqs) -> None:
    total_num_pages, page_size = kv_pages.shape[:2]
    kv_lens, page_indices = np.asarray(kv_lens), np.asarray(page_indices)  # one copy to host
    for i in range(int(num_seqs[0])):  # only the live sequences: the rest is padding
        used = -(-int(kv_lens[i]) // page_size)  # its other columns are unused, may hold anything
        for j in range(used):
            page = int(page_indices[i, j])
            if not 0 <= page < total_num_pages:
                raise RPAInputError(
                    f"page_indices[{i}, {j}]={page} is not a page of kv_pages, whose "
                    f"{total_num_pages=}.",
                    f"sequence {i} (kv_len={int(kv_lens[i])}) uses its first {used} columns; "
                    "each must hold a page number in [0, total_num_pages).",
                )

"""Solutions to notebook 00 (setup and tour)."""


def pages_needed(kv_len: int, page_size: int) -> int:
    # Ceiling division without floats: -(-a // b) rounds up, and 0 tokens need 0 pages.
    return -(-kv_len // page_size)

"""N-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, for the longest n in [lookup_min, lookup_max] that occurs. Copy-heavy
requests (repeat, edit or quote a given text) continue what they copy."""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from jpaged.spec_decode.proposer import Proposer


def propose_ngram(token_ids, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to k draft tokens after `token_ids` (empty: no earlier occurrence of any suffix)."""
    if k < 1:
        return []
    tokens = np.asarray(token_ids, np.int64)
    length = len(tokens)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        # Windows starting at 0 .. length - n - 1: every occurrence but the suffix itself.
        windows = sliding_window_view(tokens[:length - 1], n)
        starts = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(starts):
            follow = starts[-1] + n  # the latest occurrence: the text being copied now
            return tokens[follow:follow + k].tolist()
    return []


class NgramProposer(Proposer):
    """Drafts while scheduling, on the host; no device state."""

    def __init__(self, config):
        self.lookup_min, self.lookup_max = config.lookup_min, config.lookup_max

    def draft(self, token_ids: list[int], k: int) -> list[int]:
        return propose_ngram(token_ids, k, self.lookup_min, self.lookup_max)

"""
Long documents cut into windows of at most max_length tokens.
Cut long documents into windows of at most max_length tokens, under nanochat's convention
([BOS] + document, the BOS again at each window's start) or GPT-Simple's (document + EOD, no BOS).
Later windows repeat the last `overlap` tokens as context; their overlap prefix counts them.
Design: docs/pretokenized.md.

May import: numpy, nanochat.data.base.packing, nanochat.data.pretokenized.token_shards.
"""

import numpy as np

from nanochat.data.base.packing import next_cut
from nanochat.data.pretokenized.token_shards import MAX_OVERLAP

def check_window_args(max_length: int, overlap: int) -> None:
    """Raise ValueError unless max_length and overlap make valid windows (docs/pretokenized.md)."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (a BOS and one token), got {max_length}")
    if not 0 <= overlap <= max_length // 2:
        raise ValueError(f"overlap_size {overlap} must be between 0 and max_length // 2 = "
                         f"{max_length // 2} (max_length {max_length})")
    if overlap > max_length - 2:
        # only max_length=2, overlap=1: a window of BOS + 1 old token would bring nothing new
        raise ValueError(f"overlap_size {overlap} leaves no new token per window at max_length "
                         f"{max_length}; use overlap_size <= max_length - 2 = {max_length - 2}")
    if overlap > MAX_OVERLAP:
        raise ValueError(f"overlap_size {overlap} does not fit the format's uint16 overlap prefix "
                         f"(at most {MAX_OVERLAP}; max_length {max_length})")


def window_document(tokens: np.ndarray, max_length: int,
                    overlap: int) -> list[tuple[np.ndarray, int]]:
    """Cut one document into entries of at most max_length tokens: [(entry_tokens, overlap_prefix),
    ...]. tokens is the document as the tokenizer encodes it with prepend=BOS: tokens[0] is the BOS
    that starts every window. An entry that fits comes back whole, [(tokens, 0)]; window 0 is a view
    into tokens, later windows are new arrays of the same dtype."""
    check_window_args(max_length, overlap)
    if tokens.ndim != 1 or len(tokens) == 0:
        raise ValueError("a document is a 1-D array that starts with BOS, got shape "
                         f"{tokens.shape}")
    if len(tokens) <= max_length:
        return [(tokens, 0)]
    windows, start = [], 0
    # the loader's split policy cuts on the same grid (packing.next_cut), so a pretokenized window
    # and a split row of the same document hold the same tokens
    while start < len(tokens):
        end = min(len(tokens), next_cut(start, max_length, overlap))
        # later windows: the BOS again, then the last `overlap` old tokens as context
        windows.append((tokens[:end], 0) if start == 0 else
                       (np.concatenate((tokens[:1], tokens[start - overlap:end])), overlap))
        start = end
    return windows


def window_gpt_simple(tokens: np.ndarray, max_length: int,
                      overlap: int) -> list[tuple[np.ndarray, int]]:
    """GPT-Simple's convention: cut one document, its tokens followed by EOD and no BOS, into
    entries of at most max_length tokens: [(entry_tokens, overlap_prefix), ...], all views into
    tokens. Window k starts at k * (max_length - overlap); every window after the first repeats the
    overlap tokens before its new ones, and its overlap prefix counts them (from the entry's start:
    there is no BOS). Only the last window holds the EOD, and each window brings at least one new
    token."""
    check_window_args(max_length, overlap)
    if tokens.ndim != 1 or len(tokens) == 0:
        raise ValueError(f"a document is a 1-D array that ends with EOD, got shape {tokens.shape}")
    windows = [(tokens[:max_length], 0)]
    # start: the window's first new token. Stopping at len(tokens) writes no window of old tokens
    # only, which GPT-Simple's own writer can make
    for start in range(max_length, len(tokens), max_length - overlap):
        windows.append((tokens[start - overlap:start - overlap + max_length], overlap))
    return windows

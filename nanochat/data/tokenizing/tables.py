"""
A tokenizer's tables checked before tiktoken is handed them.
The tables a file or a training run gives (the name, the split pattern, the mergeable tokens' ranks,
the special tokens' ids, the BOS token) must make a usable tokenizer: tiktoken panics, rather than
raising ValueError, on some bad ones, and a stray huge id would make every table of vocab size huge.

Cost: one pass over the tables (~65k entries for a 65k vocab).

May import: nanochat.data.base.checks.
"""

from nanochat.data.base.checks import is_int

MAX_ID_GAP = 1024  # unused ids a loaded tokenizer may have (tiktoken's cl100k_base has a handful)


def check_tables(name, pattern, mergeable_ranks, special_tokens, bos_token) -> None:
    """Raise ValueError unless the tables make a usable tokenizer (a loaded file may be damaged)."""
    if not isinstance(name, str):
        raise ValueError(f"name must be a str, got {type(name).__name__}")
    if not isinstance(pattern, str):
        raise ValueError(f"pattern must be a str, got {type(pattern).__name__}")
    for _ in _id_table(mergeable_ranks, "mergeable_ranks", "bytes to rank", bytes,
                       "mergeable token", "rank"):
        pass  # the checks run as the pairs are drawn
    ranks = set(mergeable_ranks.values())
    if len(ranks) != len(mergeable_ranks):
        raise ValueError("two mergeable tokens share a rank")
    missing = [b for b in range(256) if bytes([b]) not in mergeable_ranks]
    if missing:
        # without every single byte, some text could not be encoded at all
        raise ValueError(f"{len(missing)} of the 256 single-byte tokens are missing (e.g. byte "
                         f"{missing[0]})")
    for name, token_id in _id_table(special_tokens, "special_tokens", "name to id", str,
                                    "special token", "id"):
        if token_id in ranks:
            raise ValueError(f"special token {name} has id {token_id}, which a mergeable token "
                             "already has")
    if len(set(special_tokens.values())) != len(special_tokens):
        raise ValueError("two special tokens share an id")
    if bos_token not in special_tokens:
        raise ValueError(f"bos_token {bos_token!r} is not among the special tokens "
                         f"{sorted(special_tokens)}")
    # ids index arrays of vocab size (token_bytes, embeddings): a stray huge id would make them huge
    num_tokens = len(ranks) + len(special_tokens)
    top = max(ranks | set(special_tokens.values()))
    if top >= num_tokens + MAX_ID_GAP:
        raise ValueError(f"the largest token id is {top:,} for {num_tokens:,} tokens; ids must be "
                         f"nearly dense (at most {MAX_ID_GAP} unused ids)")


def _id_table(table, argument: str, mapping: str, key_type: type, entry: str, value: str):
    """Yield the (key, id) pairs of `table`, each checked (a key_type key, an int id >= 0) before
    it is yielded; ValueError when one is not, or when table is not a dict (mapping, entry, value:
    how messages call the whole, a key and an id)."""
    if not isinstance(table, dict):
        raise ValueError(f"{argument} must be a mapping of {mapping}, got {type(table).__name__}")
    for key, token_id in table.items():
        # is_int, not check_int: the message names the entry, and this runs once per token
        if not isinstance(key, key_type) or not is_int(token_id) or token_id < 0:
            raise ValueError(f"bad {entry} {key!r} with {value} {token_id!r}")
        yield key, token_id

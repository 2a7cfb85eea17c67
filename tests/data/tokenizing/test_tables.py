"""
Tests for nanochat/data/tokenizing/tables.py: tables that make a usable tokenizer pass, and each
kind of damage a file may hold is refused with a ValueError that says what is wrong (before
tiktoken, which panics on some). Run:
    python -m pytest tests/data/tokenizing/test_tables.py -q
"""

import pytest

from nanochat.data.tokenizing.tables import MAX_ID_GAP, check_tables

BYTES = {bytes([b]): b for b in range(256)}
SPECIALS = {"<|bos|>": 256, "<|user_start|>": 257}


def tables(**changed) -> dict:
    return dict(name="t", pattern=r"\S+|\s+", mergeable_ranks=dict(BYTES),
                special_tokens=dict(SPECIALS), bos_token="<|bos|>") | changed


def test_tables_of_a_usable_tokenizer_pass():
    check_tables(**tables())
    # a few unused ids are allowed (tiktoken's own encodings have some)
    check_tables(**tables(special_tokens={"<|bos|>": 256 + MAX_ID_GAP}))


@pytest.mark.parametrize("changed, words", [
    (dict(name=None), "name must be a str, got NoneType"),
    (dict(pattern=7), "pattern must be a str, got int"),
    (dict(mergeable_ranks=[]), "mergeable_ranks must be a mapping of bytes to rank, got list"),
    (dict(mergeable_ranks=BYTES | {"ab": 300}), "bad mergeable token 'ab' with rank 300"),
    (dict(mergeable_ranks=BYTES | {b"ab": -1}), "bad mergeable token b'ab' with rank -1"),
    (dict(mergeable_ranks=BYTES | {b"ab": 2.0}), "bad mergeable token b'ab' with rank 2.0"),
    (dict(mergeable_ranks=BYTES | {b"ab": 5}), "two mergeable tokens share a rank"),
    (dict(mergeable_ranks={k: v for k, v in BYTES.items() if v != 65}),
     "1 of the 256 single-byte tokens are missing (e.g. byte 65)"),
    (dict(special_tokens="<|bos|>"), "special_tokens must be a mapping of name to id, got str"),
    (dict(special_tokens={"<|bos|>": 12}), "special token <|bos|> has id 12, which a mergeable"),
    (dict(special_tokens={"<|bos|>": 256, "<|x|>": 256}), "two special tokens share an id"),
    (dict(bos_token="<|endoftext|>"), "bos_token '<|endoftext|>' is not among the special"),
    (dict(special_tokens={"<|bos|>": 257 + MAX_ID_GAP}),
     f"the largest token id is {257 + MAX_ID_GAP:,} for 257 tokens"),
])
def test_each_kind_of_damage_is_refused_with_what_is_wrong(changed, words):
    with pytest.raises(ValueError) as error:
        check_tables(**tables(**changed))
    assert words in str(error.value)

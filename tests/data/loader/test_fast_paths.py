"""
The fast paths of the pretokenized loader against the plain code they replace, exactly: KeyEncoder
(nanochat/data/base/state.py) against encode_keys, one encoder reused over many buffers as the state
recorder reuses it; TokenShardReader.pick (nanochat/data/pretokenized/token_reader.py) against
TokenShard.entry.

    python -m pytest tests/data/loader/test_fast_paths.py -q
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from nanochat.data.base.state import DocKey, KeyEncoder, WindowKey, decode_keys, encode_keys
from nanochat.data.pretokenized.token_reader import Chunk, TokenShardReader
from nanochat.data.pretokenized.token_shards import TokenShard, write_token_shard

# a key of a unit's document or of a shuffled window's entry: small ranges, so that heads repeat
# and rows run on (the cases encode_rows shortens)
doc_keys = st.builds(DocKey, st.integers(1, 2), st.integers(0, 1), st.integers(0, 2),
                     st.integers(0, 9))
window_keys = st.builds(WindowKey, st.integers(1, 2), st.integers(0, 2), st.integers(0, 9))
buffers = st.lists(st.lists(st.one_of(doc_keys, window_keys), max_size=40), min_size=1,
                   max_size=8)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(buffers, st.integers(0, 3))
def test_key_encoder_equals_encode_keys(batches, runs):
    encoder = KeyEncoder()  # one encoder over several buffers: numbered keys are reused
    for keys in batches:
        for _ in range(runs):  # runs of consecutive rows, as a refill adds them
            if keys:
                last = keys[-1]
                keys.append(last._replace(**{last._fields[-1]: last[-1] + 1}))
        assert encoder(keys) == encode_keys(keys)
        assert decode_keys(encoder(keys)) == [tuple(key) for key in keys]


def test_key_encoder_forgets_old_keys():
    encoder = KeyEncoder()
    for start in range(0, 20_000, 1_000):  # keys that leave the buffer are forgotten in bulk
        keys = [DocKey(1, start // 5_000, start // 1_000, row) for row in range(0, 1_000, 3)]
        assert encoder(keys) == encode_keys(keys)
    assert len(encoder._codes) <= 4 * 334 + 4096


def test_pick_equals_entry(tmp_path):
    rng = np.random.default_rng(0)
    entries = [rng.integers(0, 500, size=n, dtype=np.uint16) for n in (1, 7, 0, 30, 2, 11)]
    overlaps = [0, 3, 0, 5, 1, 0]
    prefix = str(tmp_path / "shard")
    write_token_shard(prefix, entries, overlaps, np.uint16)
    shard = TokenShard(prefix)
    unit = Chunk(shard, 1, 6)
    for rows in (range(0, 5), [4, 0, 2], [], (3,)):
        picked = TokenShardReader.pick(unit, rows)
        assert [overlap for _, overlap in picked] == [overlaps[1 + r] for r in rows]
        for (tokens, _), r in zip(picked, rows):
            np.testing.assert_array_equal(tokens, shard.entry(1 + r))
        assert all(type(overlap) is int for _, overlap in picked)

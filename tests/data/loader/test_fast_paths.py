"""
The fast path of the pretokenized loader against the plain code it replaces, exactly:
TokenShardReader.pick (nanochat/data/pretokenized/token_reader.py) against TokenShard.entry.
(KeyEncoder against encode_keys: tests/data/base/test_state.py.)

    python -m pytest tests/data/loader/test_fast_paths.py -q
"""

import numpy as np

from nanochat.data.pretokenized.token_reader import Chunk, TokenShardReader
from nanochat.data.pretokenized.token_shards import TokenShard, write_token_shard


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

"""
Elastic resume: N ranks train for a while and each saves its state (here, one rank after the
other); merge_states turns the N states into the start of M ranks (2 -> 3 and 4 -> 2); the M ranks
resume as real processes (torchrun, gloo, CPU), also with shuffle=True. Every document of the
interrupted epoch(s) is placed into a row exactly once across the old and the new ranks (a cropped
document counts as placed) or still waits in exactly one new rank's buffer (best-fit may keep a
small document waiting for a long time), never both and never twice; checked on the documents'
positions and, independently, on the tokens of the rows. And the deal itself on hand-made states,
with the exact plans each new rank gets.
Run: python -m pytest tests/data/loader/test_elastic.py -q (~20 s)
"""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from conftest import TESTS, ByteTokenizer, worker_env, write_shard
from elastic_worker import run_rank
from nanochat.data.base.state import (EMPTY_HASH, DocKey, add_checksum, decode_keys, encode_keys,
                                      loader_config)
from nanochat.data.base.state_checks import check_fields
from nanochat.data.loader.elastic import merge_walk_states
from nanochat.resume import merge_states

BOS = ByteTokenizer.bos


def doc_text(i):
    # one first character (one byte = one token) per document: a document cropped to BOS + 1 token
    # is still recognisable in its row; lengths vary from 1 to 3 rows' worth
    return chr(40 + i % 80) + "xyz"[i % 3] * ((i * 7) % 60)


def torchrun(nproc, *args, shuffle=False):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", os.path.join(TESTS, "elastic_worker.py"), *map(str, args)]
    env = dict(worker_env(), NANOCHAT_TEST_SHUFFLE="1" if shuffle else "0")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(args[2]) as f:
        return json.load(f)


def check_rows_against_trace(results, text_of):
    """The traced documents of each row are exactly the row's BOS-delimited pieces, in order."""
    for r in results:
        assert len(r["rows"]) == len(r["placed"])
        for row, keys in zip(r["rows"], r["placed"]):
            starts = [i for i, t in enumerate(row) if t == BOS]
            assert starts[0] == 0 and len(starts) == len(keys)
            for start, end, key in zip(starts, starts[1:] + [len(row)], keys):
                expected = [BOS] + list(text_of[tuple(key[1:])].encode())
                if end < len(row):  # before the row's last document: whole
                    assert row[start:end] == expected
                else:  # the row's last: whole, or cropped exactly at the row's end
                    assert row[start:end] == expected[:end - start]


@pytest.mark.slow
@pytest.mark.parametrize("n_old,n_new,old_batches,shuffle",
                         [(2, 3, 6, False), (4, 2, 9, False), (2, 3, 6, True)])
def test_elastic_resume_places_every_document_once(n_old, n_new, old_batches, shuffle, tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    # 3 train shards with uneven row groups (7, 3, 11 of 5, 7, 3 documents), then a val shard
    counter = 0
    text_of = {}
    for pq_idx, (n_docs, rg_size) in enumerate([(35, 5), (21, 7), (33, 3)]):
        texts = [doc_text(counter + i) for i in range(n_docs)]
        counter += n_docs
        path = data_dir / f"shard_{pq_idx:05d}.parquet"
        write_shard(path, texts, row_group_size=rg_size)
        pf = pq.ParquetFile(path)
        for rg in range(pf.num_row_groups):
            for row, text in enumerate(pf.read_row_group(rg).column("text").to_pylist()):
                text_of[(pq_idx, rg, row)] = text
    write_shard(data_dir / "shard_00003.parquet", ["val"], row_group_size=1)

    # the old ranks here, one after the other; the new ones under torchrun
    # (through JSON, as the torchrun ranks' results, and as a checkpoint keeps a state)
    old = json.loads(json.dumps([run_rank("old", str(data_dir), old_batches, shuffle=shuffle,
                                          rank=rank, world_size=n_old) for rank in range(n_old)]))
    states = [r["state"] for r in old]
    merged = merge_states(states, n_new, data_dir=str(data_dir))
    json.dumps(merged)  # plain data, like every state
    with open(tmp_path / "merged.json", "w") as f:
        json.dump(merged, f)
    new = torchrun(n_new, "new", data_dir, tmp_path / "new.json", 400, tmp_path / "merged.json",
                   shuffle=shuffle)
    assert all(r["batches"] < 400 for r in new), "a new rank never read its whole share"
    check_rows_against_trace(old + new, text_of)

    last_epoch = max(s["next"][0] for s in states)
    placed = [tuple(key) for r in old + new for row in r["placed"] for key in row
              if key[0] <= last_epoch]
    waiting = [key for r in new for key in decode_keys(r["state"]["buffer"])
               if key[0] <= last_epoch]
    # nothing twice...
    assert len(placed) == len(set(placed)) and not set(placed) & set(waiting)
    assert len(waiting) == len(set(waiting))
    # ...and every document of every interrupted epoch once, across the old and the new ranks
    expected = {(epoch, *where) for epoch in range(1, last_epoch + 1) for where in text_of}
    assert set(placed) | set(waiting) == expected
    assert len(waiting) < len(expected) // 4  # most of them were placed
    # not vacuous: the old ranks had documents in their buffers; with 4 ranks they are even in
    # different epochs (rank 3 has the fewest row groups), so several epochs are being finished
    assert any(s["buffer"] for s in states)
    if n_old == 4:
        assert len({s["next"][0] for s in states}) > 1
    assert sum(1 for r in old for row in r["placed"] for _ in row) < len(expected)
    # after their share, the new ranks carry on with the next epoch as ranks q of M
    assert all(r["state"]["config"]["world_size"] == n_new for r in new)


# -----------------------------------------------------------------------------
# The deal on hand-made states: one train file of 2 row groups of 3 documents, 2 ranks


def rank_state(path, rank: int, next_place: list, buffered: list) -> dict:
    config = loader_config("bestfit", "parquet", "train", [path], B=2, T=8, buffer_size=4,
                           batch_size=2, tokenizer="t", rank=rank, world_size=2,
                           policy=("crop", 0))
    return add_checksum({
        "version": 2, "loader": "bestfit", "pq_idx": 0, "rg_idx": rank, "epoch": 1, "plan": [],
        "next": next_place, "buffer": encode_keys(buffered), "pieces": [], "offset": 0,
        "config": config, "emitted": {"batches": 3, "tokens": 48, "hash": EMPTY_HASH},
        "counters": {}})


@pytest.mark.parametrize("world_size,plans", [
    # the buffered document, then rank 1's begun unit's unread rows 1 and 2, all to one rank
    (1, [[{"epoch": 1, "pq_idx": 0, "rg_idx": 0, "rows": [2]},
          {"epoch": 1, "pq_idx": 0, "rg_idx": 1, "rows": [1, -1]}]]),
    # the same three documents dealt round-robin: 0 gets the 1st and the 3rd, 1 the 2nd
    (2, [[{"epoch": 1, "pq_idx": 0, "rg_idx": 0, "rows": [2]},
          {"epoch": 1, "pq_idx": 0, "rg_idx": 1, "rows": [2]}],
         [{"epoch": 1, "pq_idx": 0, "rg_idx": 1, "rows": [1]}]]),
])
def test_the_deal_gives_each_new_rank_its_exact_plan(world_size, plans, tmp_path):
    write_shard(tmp_path / "shard_00000.parquet", [f"doc {i}" for i in range(6)], 3)
    write_shard(tmp_path / "shard_00001.parquet", ["val"], 1)
    path = str(tmp_path / "shard_00000.parquet")
    # rank 0 read its unit 0 and buffers its row 2; rank 1 read row 0 of its unit 1
    states = [rank_state(path, 0, [1, 0, 2, 0], [DocKey(1, 0, 0, 2)]),
              rank_state(path, 1, [1, 0, 1, 1], [])]
    merged = merge_walk_states(states[::-1], world_size, str(tmp_path), None,
                               ["states[1]", "states[0]"])
    assert merged["merged"] == {"from_world_size": 2, "world_size": world_size}
    for q, (state, plan) in enumerate(zip(merged["states"], plans)):
        check_fields(state)
        assert state["plan"] == plan
        # after its plan: epoch 2 from its start, as rank q of world_size
        assert state["next"] == [2, 0, q, 0] and state["buffer"] == []
        assert state["config"]["rank"] == q and state["config"]["world_size"] == world_size
        assert state["emitted"] == {"batches": 3, "tokens": 0, "hash": EMPTY_HASH}

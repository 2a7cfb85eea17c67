"""
Elastic resume with real processes: N ranks (torchrun, gloo, CPU) train for a while and each saves
its state; merge_states turns the N states into the start of M ranks (2 -> 3 and 4 -> 2); the M
ranks resume (also with shuffle=True). Every document of the interrupted epoch(s) is placed into a
row exactly once across the old and the new ranks (a cropped document counts as placed) or still
waits in exactly one new rank's buffer (best-fit may keep a small document waiting for a long
time), never both and never twice; checked on the documents' positions and, independently, on the
tokens of the rows. Run: python -m pytest tests/data/loader/test_elastic.py -q (~30 s)
"""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from conftest import TESTS, ByteTokenizer, worker_env, write_shard
from nanochat.resume import merge_states
from nanochat.data.base.state import decode_keys

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
                # whole, or cropped at the row's end
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

    old = torchrun(n_old, "old", data_dir, tmp_path / "old.json", old_batches, shuffle=shuffle)
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

"""
The best-fit loader over pretokenized .bin/.idx shards: with windowing off it yields the parquet
loader's batches token for token (same documents, same tokenizer, several ranks); exact and elastic
resume; targets masked exactly at window overlaps; the attention outputs (doc_ids, position_ids,
cu_seqlens) agree with the rows; GPT-Simple's EOD-terminated shards; both conventions of our writer
train every document token once; bos_token from pretokenize.json, never guessed; bad input.
Run: python -m pytest tests/data/pretokenized/test_pretokenized_loader.py -q
"""

import random
import struct

import numpy as np
import pytest
import torch

import oracle
from conftest import buffered_places, write_shards
from nanochat.dataloader import (
    pretokenized_distributed_data_loader_with_state_bos_bestfit as PRETOKENIZED,
    tokenizing_distributed_data_loader_with_state_bos_bestfit as PARQUET,
)
from nanochat.pretokenize import main as pretokenize_main
from nanochat.data.pretokenized.token_shards import TokenShard, write_token_shard
from nanochat.resume import merge_states
from nanochat.data.base.state import decode_keys
from nanochat.data.base.layout import list_token_shards
from nanochat.tokenizer import RustBPETokenizer

WORDS = "the data loader packs rows of tokens into batches while windows overlap 12 345 é".split()
ROW_GROUP = 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Parquet shards (row groups of 8, uneven lengths, some documents longer than a row), a BPE
    tokenizer trained on them, and their pretokenized twins, whole and windowed."""
    root = tmp_path_factory.mktemp("pretok")
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.choice([0, 3, 10, 30, 80])))
             for _ in range(150)]
    write_shards(root / "parquet", [texts[:60], texts[60:130], texts[130:]],
                 row_group_size=ROW_GROUP)
    tokenizer = RustBPETokenizer.train_from_iterator(iter(texts), 300)
    tokenizer.save(str(root / "tokenizer"))
    common = ["--input", str(root / "parquet"), "--tokenizer-dir", str(root / "tokenizer"),
              "--num-workers", "1"]
    assert pretokenize_main(common + ["--output", str(root / "whole")]) == 0
    assert pretokenize_main(common + ["--output", str(root / "windowed"), "--max-length", "17",
                                      "--overlap-size", "5"]) == 0
    return root, tokenizer


def rows_of(inputs, targets):
    return torch.cat([inputs, targets[:, -1:]], dim=1)


POLICIES = [("crop", 0), ("split", 3), ("split_reuse", 2)]


@pytest.mark.parametrize("policy,overlap", POLICIES)
@pytest.mark.parametrize("world_size,rank", [(1, 0), (2, 1), (3, 0)])
@pytest.mark.parametrize("split", ["train", "val"])
def test_same_batches_as_the_parquet_loader(corpus, world_size, rank, split, policy, overlap):
    root, tokenizer = corpus
    kw = dict(device="cpu", buffer_size=7, rank=rank, world_size=world_size, long_doc_policy=policy,
              split_overlap=overlap)
    parquet = PARQUET(tokenizer, 3, 24, split, tokenizer_batch_size=5,
                      data_dir=str(root / "parquet"), **kw)
    pretok = PRETOKENIZED(3, 24, split, data_dir=str(root / "whole"), chunk_size=ROW_GROUP,
                          batch_size=5, **kw)
    for k in range(400):  # past the end of the data: epochs wrap the same way
        if k >= 25 and ps["epoch"] >= 2:
            break
        x, y, s = next(parquet)
        px, py, ps = next(pretok)
        assert torch.equal(x, px) and torch.equal(y, py), f"batch {k}"
        assert {key: s[key] for key in ("pq_idx", "rg_idx", "epoch", "next")} == \
            {key: ps[key] for key in ("pq_idx", "rg_idx", "epoch", "next")}
        # the same tokens, so the same fingerprint
        assert s["emitted"]["hash"] == ps["emitted"]["hash"]
    assert ps["epoch"] >= 2


@pytest.mark.parametrize("policy,overlap", POLICIES)
@pytest.mark.parametrize("data", ["whole", "windowed"])
def test_exact_resume(corpus, data, policy, overlap):
    root, _ = corpus
    kw = dict(device="cpu", buffer_size=6, data_dir=str(root / data), chunk_size=5, batch_size=3,
              rank=1, world_size=2, long_doc_policy=policy, split_overlap=overlap)
    loader = PRETOKENIZED(2, 16, "train", **kw)
    run = [(rows_of(x, y).clone(), y.clone(), s) for x, y, s in (next(loader) for _ in range(30))]
    assert any(s["buffer"] for _, _, s in run)
    for k in (0, 7, 18):
        resumed = PRETOKENIZED(2, 16, "train", resume_state_dict=run[k][2], **kw)
        for rows, targets, state in run[k + 1:]:
            x, y, s = next(resumed)
            assert torch.equal(rows_of(x, y), rows) and torch.equal(y, targets) and s == state


def test_window_overlaps_are_masked_exactly(corpus):
    """Every -100 target predicts a token that repeats the previous window, and every such target
    that made it into a row is -100; nothing else is masked."""
    root, _ = corpus
    shards = [TokenShard(p) for p in list_token_shards(str(root / "windowed" / "train"))]
    assert any(s.overlaps.any() for s in shards)
    loader = PRETOKENIZED(4, 20, "train", device="cpu", buffer_size=5,
                          data_dir=str(root / "windowed"), chunk_size=ROW_GROUP, batch_size=4,
                          trace_documents=True)
    masked_total = 0
    for _ in range(20):
        x, y, _ = next(loader)
        for r, keys in enumerate(loader.documents):
            expected = torch.zeros(20, dtype=torch.bool)
            starts = [0]
            for key in keys:
                _, pq_idx, chunk, row_in_chunk = key
                entry = pq_idx, chunk * ROW_GROUP + row_in_chunk
                n = len(shards[entry[0]].entry(entry[1]))
                overlap = int(shards[entry[0]].overlaps[entry[1]])
                start = starts[-1]
                placed = min(n, 21 - start)
                expected[start:start + min(overlap, placed - 1)] = True
                starts.append(start + placed)
            assert starts[-1] == 21  # the trace accounts for every token of the row
            assert torch.equal(y[r] == -100, expected)
            masked_total += int(expected.sum())
    assert masked_total > 0
    assert loader.stats["tokens_masked"] == masked_total


@pytest.mark.parametrize("policy,overlap", POLICIES[1:] + [("split", 0), ("split_reuse", 6)])
def test_windows_split_by_a_policy_match_the_oracle(corpus, policy, overlap):
    """Windows of 17 tokens (overlap 5) in rows of 13: a window's own overlap and a piece's overlap
    are both masked, exactly where the token-tagged oracle says (tests/oracle.py), one rank."""
    root, _ = corpus
    B, T, chunk, batch = 3, 12, 6, 4
    entries = []  # (tokens, window overlap) in the order one rank reads them, in batches of `batch`
    for prefix in list_token_shards(str(root / "windowed" / "train")):
        shard = TokenShard(prefix)
        for c in range(0, len(shard), chunk):
            ids = range(c, min(c + chunk, len(shard)))
            entries += [[(shard.entry(i).tolist(), int(shard.overlaps[i]))
                         for i in ids[j:j + batch]]
                        for j in range(0, len(ids), batch)]
    assert any(w for group in entries for _, w in group) and any(
        len(t) > T + 1 for group in entries for t, _ in group)
    stream = (group for _ in range(3) for group in entries)  # epochs repeat the same order
    buffer, docs = [], {}

    def refill():
        for tokens, window in next(stream):
            docs[len(docs)] = tokens
            buffer.extend(oracle.split_document(tokens, len(docs) - 1, T + 1, overlap, window))

    loader = PRETOKENIZED(B, T, "train", device="cpu", buffer_size=5,
                          data_dir=str(root / "windowed"), chunk_size=chunk, batch_size=batch,
                          long_doc_policy=policy, split_overlap=overlap)
    masked = 0
    for k in range(25):
        rows, _ = oracle.bestfit_policy_rows(buffer, refill, B, T + 1, 5, policy, overlap, docs)
        x, y, _ = next(loader)
        assert x.tolist() == [[t[0] for t in row[:-1]] for row in rows], f"batch {k}"
        assert y.tolist() == [[-100 if t[4] else t[0] for t in row[1:]]
                              for row in rows], f"batch {k}"
        masked += sum(t[4] for row in rows for t in row[1:])
    assert loader.stats["tokens_masked"] == masked > 0
    assert (loader.stats["tokens_repeated"] > 0) == (overlap > 0)


def test_attention_outputs_agree_with_the_rows(corpus):
    root, _ = corpus
    B, T = 3, 24
    loader = PRETOKENIZED(B, T, "train", device="cpu", buffer_size=6, data_dir=str(root / "whole"),
                          attention_info=True, max_docs_per_row=12)
    for _ in range(10):
        x, y, _, info = next(loader)
        assert info["cu_seqlens"].shape == (B * 12 + 1,) and info["cu_seqlens"].dtype == torch.int32
        bounds = []
        for r in range(B):
            starts = (x[r] == x[0, 0]).nonzero().flatten().tolist()  # BOS positions in the inputs
            assert starts[0] == 0
            ids = torch.zeros(T, dtype=torch.int32)
            pos = torch.zeros(T, dtype=torch.int64)
            for i, (s, e) in enumerate(zip(starts, starts[1:] + [T])):
                ids[s:e] = i
                pos[s:e] = torch.arange(e - s)
            assert torch.equal(info["doc_ids"][r], ids)
            assert torch.equal(info["position_ids"][r], pos)
            bounds += [r * T + s for s in starts]
        expected = bounds + [B * T] * (B * 12 + 1 - len(bounds))
        assert info["cu_seqlens"].tolist() == expected


def test_max_docs_per_row_is_enforced(corpus):
    root, _ = corpus
    loader = PRETOKENIZED(2, 64, "train", device="cpu", buffer_size=20,
                          data_dir=str(root / "whole"), attention_info=True, max_docs_per_row=1)
    with pytest.raises(ValueError, match="max_docs_per_row"):
        for _ in range(20):
            next(loader)


@pytest.mark.parametrize("shuffle", [False, True])
def test_elastic_resume_in_process(corpus, shuffle):
    root, _ = corpus
    kw = dict(device="cpu", buffer_size=5, data_dir=str(root / "whole"), chunk_size=4, batch_size=3,
              trace_documents=True, shuffle=shuffle, seed=1, shuffle_window=3)
    placed, states = [], []
    for rank in range(2):
        loader = PRETOKENIZED(2, 16, "train", rank=rank, world_size=2, **kw)
        for _ in range(6):
            _, _, state = next(loader)
            placed += [tuple(k) for row in loader.documents for k in row]
        states.append(state)
    merged = merge_states(states, 3, data_dir=str(root / "whole"))
    last_epoch = max(s["next"][0] for s in states)
    paths = [prefix + ".bin" for prefix in list_token_shards(str(root / "whole" / "train"))]
    waiting = []
    for rank in range(3):
        loader = PRETOKENIZED(2, 16, "train", rank=rank, world_size=3, resume_state_dict=merged,
                              **kw)
        state = merged["states"][rank]
        while state["plan"]:
            _, _, state = next(loader)
            placed += [tuple(k) for row in loader.documents for k in row]
        # (a shuffled state names them by position)
        waiting += buffered_places(state, paths, chunk_size=4)
    done = [k for k in placed if k[0] <= last_epoch] + [k for k in waiting if k[0] <= last_epoch]
    lengths = [len(TokenShard(p)) for p in paths]
    expected = {(e, f, i // 4, i % 4) for e in range(1, last_epoch + 1)
                for f, n in enumerate(lengths) for i in range(n)}
    assert len(done) == len(set(done)) and set(done) == expected


def test_gpt_simple_eod_shards(tmp_path):
    """Entries without BOS that end with EOD (GPT-Simple's writer): EOD is passed as bos_token and
    prepended to every entry, so rows still start with a delimiter."""
    eod = 9
    entries = [np.array([1, 2, 3, eod]), np.array([4, 5, eod]), np.array([6, eod])] * 4
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
        write_token_shard(str(tmp_path / split / "shard_00000"), entries, [0] * len(entries),
                          np.uint16)
    loader = PRETOKENIZED(1, 7, "train", device="cpu", buffer_size=2, data_dir=str(tmp_path),
                          bos_token=eod)
    x, y, _ = next(loader)
    row = torch.cat([x[0], y[0, -1:]]).tolist()
    # best fit: [EOD 1 2 3 EOD] (5 tokens), then the largest that fits the 3 left, [EOD 6 EOD]
    assert row == [eod, 1, 2, 3, eod, eod, 6, eod]


def trained_positions(data_dir, convention: str, documents: list[list[int]], B: int,
                      T: int) -> dict:
    """{document: [indices of its tokens that a target trains]}, read off the rows, targets and
    traces of one epoch of the pretokenized loader on data_dir (train; its bos_token from
    pretokenize.json), with long_doc_policy="split_reuse" so that nothing is cropped away. A
    document is its tokens, plus EOD under gpt-simple; a target that predicts the BOS starting a
    document or piece trains none of them."""
    shards = [TokenShard(p) for p in list_token_shards(str(data_dir / "train"))]
    # each entry: its document, and where its body (the tokens after its BOS: all of them under
    # gpt-simple, where the loader prepends one) starts in the document; checked against the
    # document
    where, d = {}, 0
    for f, shard in enumerate(shards):
        covered = 0
        for i in range(len(shard)):
            entry, overlap = shard.entry(i).tolist(), int(shard.overlaps[i])
            body = entry if convention == "gpt-simple" else entry[1:]
            start = covered - overlap
            assert body == documents[d][start:start + len(body)]
            where[(f, i)] = (d, start)
            covered = start + len(body)
            if covered == len(documents[d]):
                d, covered = d + 1, 0
    assert d == len(documents)
    bos = shards[0].entry(0)[0] if convention == "nanochat" else documents[0][-1]
    loader = PRETOKENIZED(B, T, "train", device="cpu", data_dir=str(data_dir), chunk_size=ROW_GROUP,
                          batch_size=4, buffer_size=5, trace_documents=True,
                          long_doc_policy="split_reuse")
    trained = {d: [] for d in range(len(documents))}
    pieces = 0
    for _ in range(2000):  # an epoch is ~150 batches here (8,357 tokens and the windows' repeats)
        x, y, state = next(loader)
        rows = rows_of(x, y)
        for r, keys in enumerate(loader.documents):
            pos = 0
            for key in keys:
                epoch, f, chunk, row = key[:4]
                start = getattr(key, "start", None)  # a PieceKey: a piece of a split document
                tokens = shards[f].entry(chunk * ROW_GROUP + row).tolist()
                # what the loader packs
                doc = [bos] + tokens if convention == "gpt-simple" else tokens
                # a piece: BOS + doc[start:]
                length = len(doc) if not start else 1 + len(doc) - start
                # placed whole, or cropped at the row's end (the rest comes back)
                m = min(length, T + 1 - pos)
                placed = doc[:m] if not start else [doc[0]] + doc[start:start + m - 1]
                assert rows[r, pos:pos + m].tolist() == placed
                d, body_start = where[(f, chunk * ROW_GROUP + row)]
                for p in range(pos + 1, pos + m):  # the target at p - 1 predicts the token at p
                    j = p - pos if not start else start + p - pos - 1  # its index in doc
                    if epoch == 1 and y[r, p - 1] != -100:
                        trained[d].append(body_start + j - 1)
                pieces += start is not None
                pos += m
            assert pos == T + 1  # the trace accounts for every token of the row
        if any(k[0] > 1 for keys in loader.documents for k in keys) and \
                not any(k[0] == 1 for k in decode_keys(state["buffer"])):
            break  # epoch 2 has begun and nothing of epoch 1 waits in the buffer
    else:
        pytest.fail("epoch 1 was not done within 2000 batches")
    loader.close()
    assert pieces > 0  # guard: some documents were cut across rows
    return trained


@pytest.mark.slow
@pytest.mark.parametrize("max_length,overlap", [(17, 5), (9, 0)])
def test_both_conventions_train_the_same_targets(corpus, tmp_path, max_length, overlap):
    """The same corpus pretokenized in both conventions, windowed, and read by our loader with
    bos_token from pretokenize.json: every document's tokens are trained exactly once each, none
    twice (the windows' overlaps are masked), none lost; under gpt-simple its EOD (our BOS id, after
    the last token) is trained once too, also where an entry is that EOD alone (an empty document,
    or a last window)."""
    import pyarrow.parquet as pq
    root, tokenizer = corpus
    bos = tokenizer.get_bos_token_id()
    texts = [t for name in ("shard_00000", "shard_00001")  # the train shards
             for t in pq.read_table(
                 root / "parquet" / f"{name}.parquet").column("text").to_pylist()]
    documents = tokenizer.encode(texts, num_threads=1)
    trained = {}
    for convention in ("nanochat", "gpt-simple"):
        out = tmp_path / convention
        assert pretokenize_main(["--input", str(root / "parquet"),
                                 "--tokenizer-dir", str(root / "tokenizer"),
                                 "--num-workers", "1", "--output", str(out),
                                 "--max-length", str(max_length),
                                 "--overlap-size", str(overlap), "--convention", convention]) == 0
        with_eod = [doc + [bos] for doc in documents] if convention == "gpt-simple" else documents
        trained[convention] = trained_positions(out, convention, with_eod, 4, 15)
    lone_eod = [d for d, doc in enumerate(documents) if len(doc) % max_length == 0]
    assert lone_eod  # guard: some entries are EOD alone (the empty documents, at least)
    for d, doc in enumerate(documents):
        assert sorted(trained["nanochat"][d]) == list(range(len(doc)))  # each token once
        assert sorted(trained["gpt-simple"][d]) == list(range(len(doc) + 1))  # and the EOD
    assert any(len(doc) > max_length for doc in documents)  # guard: documents were cut into windows


def test_missing_data_names_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m nanochat.pretokenize"):
        PRETOKENIZED(2, 8, "train", device="cpu", data_dir=str(tmp_path))
    (tmp_path / "train").mkdir()
    with pytest.raises(FileNotFoundError, match="no .bin/.idx pairs"):
        PRETOKENIZED(2, 8, "train", device="cpu", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="split"):
        PRETOKENIZED(2, 8, "test", device="cpu", data_dir=str(tmp_path))


# -----------------------------------------------------------------------------
# Token ids against the vocabulary (pretokenize.json records 300 ids; the BPE tokenizer above)


def _copy_whole(corpus, tmp_path):
    import shutil
    root, _ = corpus
    return shutil.copytree(root / "whole", tmp_path / "whole")


def _rows(loader, n):
    return [rows_of(x, y).clone() for x, y, _ in (next(loader) for _ in range(n))]


def test_flipped_bin_bytes_name_the_shard_and_entry(corpus, tmp_path):
    """Both bytes of one token flipped: the chunk holding it raises a ValueError with the shard's
    path, the entry, the id and where the vocabulary size came from, before any of its ids reach a
    batch."""
    from nanochat.data.pretokenized.token_shards import TokenShard
    data = _copy_whole(corpus, tmp_path)
    shard = TokenShard(data / "train" / "shard_00001")
    # in the second chunk of 8
    entry = next(i for i in range(12, len(shard)) if len(shard.entry(i)) > 3)
    at = int(shard.offsets[entry]) + 2
    old = int(shard.tokens[at])
    del shard
    with open(data / "train" / "shard_00001.bin", "r+b") as f:
        f.seek(2 * at)
        f.write(struct.pack("<H", old ^ 0xFFFF))
    message = (f"{data / 'train' / 'shard_00001.bin'}: entry {entry} holds token id "
               f"{old ^ 0xFFFF} (token 2 of the entry), outside the vocabulary [0, 300) "
               f"({data / 'pretokenize.json'}); the shard is damaged or was written with another "
               "tokenizer: delete the pair and rerun python -m nanochat.pretokenize")
    for prefetch in (0, 2):
        loader = PRETOKENIZED(2, 16, "train", device="cpu", buffer_size=4, data_dir=str(data),
                              chunk_size=ROW_GROUP, batch_size=4, prefetch=prefetch)
        batches = []
        with pytest.raises(ValueError) as info:
            for _ in range(200):
                batches.append(rows_of(*next(loader)[:2]).clone())
        assert str(info.value) == message
        # read and checked as it goes
        assert len(batches) >= 3 and all((b < 300).all() for b in batches)
        loader.close()


def test_ids_are_checked_up_to_the_last_id_of_the_vocabulary(tmp_path):
    """vocab_size (and bos_token) given as arguments (no pretokenize.json): id vocab_size - 1
    passes, vocab_size fails."""
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
    entries = [np.array([7, 99, 1, 2]), np.array([7, 4, 5]), np.array([7, 6])] * 3
    write_token_shard(str(tmp_path / "train" / "shard_00000"), entries, [0] * 9, np.uint16)
    kw = dict(device="cpu", buffer_size=2, data_dir=str(tmp_path), vocab_size=100, bos_token=7)
    loader = PRETOKENIZED(1, 5, "train", **kw)
    x, y, _ = next(loader)
    assert rows_of(x, y)[0].tolist() == [7, 99, 1, 2, 7, 6]  # best fit: the longest first
    entries[4] = np.array([7, 100, 5])
    write_token_shard(str(tmp_path / "train" / "shard_00000"), entries, [0] * 9, np.uint16)
    loader = PRETOKENIZED(1, 5, "train", **kw)
    with pytest.raises(ValueError) as info:
        next(loader)
    assert str(info.value).startswith(
        f"{tmp_path / 'train' / 'shard_00000.bin'}: entry 4 holds token id 100 "
        "(token 1 of the entry), outside the vocabulary [0, 100) (the vocab_size argument); ")


def test_bos_token_outside_the_vocabulary(corpus, tmp_path):
    root, _ = corpus
    kw = dict(device="cpu", data_dir=str(root / "whole"))
    with pytest.raises(ValueError) as info:
        PRETOKENIZED(2, 8, "train", bos_token=-1, **kw)
    assert str(info.value) == "bos_token is -1; token ids are >= 0"
    with pytest.raises(ValueError) as info:
        PRETOKENIZED(2, 8, "train", bos_token=300, **kw)
    settings = root / "whole" / "pretokenize.json"
    assert str(info.value) == f"bos_token is 300, outside the vocabulary [0, 300) ({settings})"
    with pytest.raises(ValueError) as info:
        PRETOKENIZED(2, 8, "train", bos_token=300, vocab_size=300, **kw)
    assert str(info.value) == (
        "bos_token is 300, outside the vocabulary [0, 300) (the vocab_size argument)")
    with pytest.raises(TypeError, match="bos_token must be an int token id, got '1'"):
        PRETOKENIZED(2, 8, "train", bos_token="1", **kw)
    # no vocabulary known: the shards' dtype is the bound (a uint16 shard cannot hold id 65536)
    (tmp_path / "train").mkdir()
    write_token_shard(str(tmp_path / "train" / "a"), [np.array([9, 1, 2])], [0], np.uint16)
    with pytest.raises(ValueError) as info:
        PRETOKENIZED(2, 8, "train", device="cpu", data_dir=str(tmp_path), bos_token=65536)
    assert str(info.value) == (
        f"bos_token is 65536, which the uint16 ids of {tmp_path / 'train' / 'a.bin'} cannot "
        "hold, so it is not these shards' BOS; pass the BOS id of the tokenizer that wrote them")
    # fits: accepted
    PRETOKENIZED(2, 8, "train", device="cpu", data_dir=str(tmp_path), bos_token=65535)


def test_no_bos_is_guessed(tmp_path):
    """Shards with no pretokenize.json (GPT-Simple's: no BOS, EOD last): without bos_token, a
    ValueError at the call, before any batch, that says to pass it and shows the first ids; no id
    is taken for BOS."""
    eod = 9
    (tmp_path / "train").mkdir()
    entries = [np.array([5, 1, 2, eod]), np.array([5, 3, eod]), np.array([6, eod]),
               np.array([], np.int64)]
    write_token_shard(str(tmp_path / "train" / "a"), entries, [0] * 4, np.uint16)
    bin_path = tmp_path / "train" / "a.bin"
    with pytest.raises(ValueError) as info:
        PRETOKENIZED(2, 8, "train", device="cpu", data_dir=str(tmp_path), vocab_size=300)
    assert str(info.value) == (
        f"no pretokenize.json records the BOS of the shards of {bin_path} (looked in {tmp_path}), "
        "and the loader does not guess it: pass bos_token=, the BOS id of the tokenizer that wrote "
        "them (for GPT-Simple's shards, which have no BOS, their EOD id: it is prepended to every "
        "entry). Entries 0 to 3 of "
        f"{bin_path} start with the ids 5, 5, 6, (empty).")
    x, y, _ = next(PRETOKENIZED(1, 5, "train", device="cpu", data_dir=str(tmp_path), bos_token=eod,
                                buffer_size=2))
    # best fit: [EOD 5 1 2 EOD], then the empty [EOD]
    assert rows_of(x, y)[0].tolist() == [eod, 5, 1, 2, eod, eod]


def test_the_recorded_bos_and_the_check_of_every_entry(corpus, tmp_path, caplog):
    """bos_token defaults to the BOS that pretokenize.json records, and every entry must start with
    it: in the first chunk of the first shard, at the call; elsewhere, when its chunk is read,
    before any of its tokens reach a batch. A caller who passes bos_token vouches for the shards:
    no such check."""
    from nanochat.data.pretokenized.token_shards import TokenShard
    root, tokenizer = corpus
    bos = tokenizer.get_bos_token_id()
    data = _copy_whole(corpus, tmp_path)
    settings = data / "pretokenize.json"
    kw = dict(device="cpu", buffer_size=4, data_dir=str(data), chunk_size=ROW_GROUP, batch_size=4)
    assert all(torch.equal(a, b) for a, b in zip(
        _rows(PRETOKENIZED(2, 16, "train", **kw), 8),
        _rows(PRETOKENIZED(2, 16, "train", bos_token=bos, **kw), 8)))

    def set_first_token(name, entry, token):
        at = int(TokenShard(data / "train" / name).offsets[entry])
        with open(data / "train" / f"{name}.bin", "r+b") as f:
            f.seek(2 * at)
            f.write(struct.pack("<H", token))

    def message(name, entry, ids):
        return (f"{data / 'train' / name}.bin: entry {entry} does not start with the BOS {bos} "
                f"that {settings} records (nanochat's convention: every entry starts with it); "
                "the shard is damaged or was written with other settings: delete the pair and "
                "rerun python -m nanochat.pretokenize (for GPT-Simple's shards, which have no BOS, "
                f"pass bos_token=, their EOD id). Entries {entry} to {entry + 7} of "
                f"{data / 'train' / name}.bin start with the ids {ids}.")

    set_first_token("shard_00000", 3, 7)
    with pytest.raises(ValueError) as info:
        PRETOKENIZED(2, 16, "train", **kw)
    assert str(info.value) == message("shard_00000", 3, f"7, {', '.join([str(bos)] * 7)}")
    set_first_token("shard_00000", 3, bos)
    set_first_token("shard_00001", 12, 7)  # in the second chunk of 8 of the second shard
    batches = []
    loader = PRETOKENIZED(2, 16, "train", **kw)
    with pytest.raises(ValueError) as info:
        for _ in range(200):
            batches.append(rows_of(*next(loader)[:2]).clone())
    assert str(info.value) == message("shard_00001", 12, f"7, {', '.join([str(bos)] * 7)}")
    assert len(batches) >= 3  # the chunks before it were read and trained
    with caplog.at_level("WARNING", logger="nanochat.dataloader"):
        # passed: the caller's word, unchecked
        next(PRETOKENIZED(2, 16, "train", bos_token=bos, **kw))
        assert not caplog.records
        next(PRETOKENIZED(2, 16, "train", bos_token=5, **kw))
    assert [r.getMessage() for r in caplog.records] == [
        f"bos_token 5 is not the bos_token_id {bos} that {settings} records; it is prepended to "
        "every entry that does not start with it"]


def test_vocab_size_must_agree_with_pretokenize_json(corpus):
    root, _ = corpus
    kw = dict(device="cpu", buffer_size=5, data_dir=str(root / "whole"), chunk_size=ROW_GROUP,
              batch_size=4)
    with pytest.raises(ValueError) as info:
        PRETOKENIZED(2, 16, "train", vocab_size=4096, **kw)
    assert str(info.value) == (f"vocab_size 4,096 (the vocab_size argument) disagrees with 300 "
                               f"({root / 'whole' / 'pretokenize.json'}); pass the vocab_size of "
                               "the tokenizer that wrote the shards, and keep shards of different "
                               "tokenizers apart")
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="vocab_size must be an integer >= 1"):
            PRETOKENIZED(2, 16, "train", vocab_size=bad, **kw)
    # agreeing: the same batches as with the file alone
    assert all(torch.equal(a, b) for a, b in zip(
        _rows(PRETOKENIZED(2, 16, "train", vocab_size=300, **kw), 10),
        _rows(PRETOKENIZED(2, 16, "train", **kw), 10)))


def test_pretokenize_json_old_or_damaged(corpus, tmp_path, caplog):
    """A pretokenize.json without vocab_size and the convention fields is read (no vocabulary
    known: a warning, once per directory; the nanochat convention); one that is not JSON, or holds
    a bad field, is a ValueError naming it."""
    import json
    data = _copy_whole(corpus, tmp_path)
    settings = json.loads((data / "pretokenize.json").read_text())
    del settings["vocab_size"], settings["convention"], settings["eod_token_id"]
    (data / "pretokenize.json").write_text(json.dumps(settings))
    kw = dict(device="cpu", buffer_size=5, data_dir=str(data), chunk_size=ROW_GROUP, batch_size=4)
    with caplog.at_level("WARNING", logger="nanochat.dataloader"):
        expected = _rows(PRETOKENIZED(2, 16, "train", vocab_size=300, **kw), 6)
        assert not caplog.records
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(
                _rows(PRETOKENIZED(2, 16, "train", **kw), 6), expected))
    assert [r.getMessage() for r in caplog.records] == [
        f"no vocabulary size for the shards in {data / 'train'} (no pretokenize.json with "
        "vocab_size next to them, no vocab_size argument): their token ids are checked only "
        "against their dtype (uint16); pass vocab_size to catch a damaged shard before the model "
        "sees its ids"]
    (data / "pretokenize.json").write_text("{not json")
    with pytest.raises(ValueError) as info:
        PRETOKENIZED(2, 16, "train", **kw)
    fix = ("restore the file, or remove it and pass the tokenizer's vocab_size and bos_token to "
           "the loader")
    assert str(info.value) == (f"{data / 'pretokenize.json'} (pretokenize's settings) is not "
                               "valid JSON: Expecting property name enclosed in double quotes: "
                               f"line 1 column 2 (char 1); {fix}")
    for text, problem in (
            ("[300]", " holds a JSON list, not pretokenize's settings"),
            ('{"vocab_size": "300"}', ": vocab_size must be a positive integer, got '300'"),
            ('{"vocab_size": 0}', ": vocab_size must be a positive integer, got 0"),
            ('{"bos_token_id": -1}', ": bos_token_id must be a non-negative integer, got -1"),
            ('{"eod_token_id": 2.0}', ": eod_token_id must be a non-negative integer, got 2.0"),
            ('{"convention": "megatron"}',
             ": convention must be one of ['nanochat', 'gpt-simple'], got 'megatron'")):
        (data / "pretokenize.json").write_text(text)
        with pytest.raises(ValueError) as info:
            PRETOKENIZED(2, 16, "train", **kw)
        assert str(info.value) == f"{data / 'pretokenize.json'}{problem}; {fix}"
    # a file that records no BOS is no help: bos_token must be passed
    (data / "pretokenize.json").write_text('{"vocab_size": 300}')
    with pytest.raises(ValueError, match="no pretokenize.json records the BOS .* pass bos_token="):
        PRETOKENIZED(2, 16, "train", **kw)

"""
Seeded shuffling (shuffle=True, seed=, shuffle_window=), tested as the unshuffled loaders are:
- the keyed permutation: a bijection for any n, the same values on every machine (pinned);
- the shuffled walk token for token against a slow oracle (tests/oracle.py), both parquet
  loaders;
- exact resume after every batch (parquet best-fit, split_reuse, concatenating; pretokenized);
- elastic restarts in one process that place every document once, a chained merge, exact resume
  mid-plan (the pretokenized loader's: tests/data/pretokenized/test_pretokenized_loader.py);
- mixture buckets: exact resume, and merges that deal nothing twice;
- what a shuffled loader refuses, and the state's size;
- how far apart the windows of one document land, shuffled and not.
Run: python -m pytest tests/data/base/test_shuffle.py -q
"""

import json
import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import oracle
from conftest import (ByteTokenizer, buffered_places, slow_beyond, take, take_across_epoch,
                      write_shards)
from nanochat.dataloader import (
    pretokenized_distributed_data_loader_with_state_bos_bestfit as PRETOKENIZED,
)
from nanochat.data.base.datasets import split_parquet_files
from nanochat.mixture import pretokenized_mixture_loader_with_state_bos_bestfit as MIX
from nanochat.pretokenize import main as pretokenize_main
from nanochat.resume import merge_states
from nanochat.data.base.shuffle import Shuffle, permutation, permute, round_keys
from nanochat.data.base.state import decode_keys
from nanochat.data.pretokenized.token_shards import TokenShard
from nanochat.data.base.layout import list_token_shards
from test_resume import (BOS, check_rows_against_trace, elastic_corpus, open_loader, random_corpus,
                         texts_by_key, write_token_dir)

SHUFFLED = dict(shuffle=True, seed=5, shuffle_window=2)


# -----------------------------------------------------------------------------
# 1. the permutation


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3000), seed=st.integers(-2**63, 2**63 - 1), purpose=st.text(max_size=5))
def test_permutation_is_a_bijection_evaluated_anywhere(n, seed, purpose):
    keys = round_keys(seed, purpose)
    p = permutation(n, keys)
    assert sorted(p.tolist()) == list(range(n))
    # any element on its own, in any order: the order is a function, not a list to store
    picks = np.random.default_rng(abs(seed) % 1000).integers(0, max(n, 1), size=min(n, 20))
    if n:
        assert permute(picks, n, keys).tolist() == p[picks].tolist()


def test_permutation_values_are_pinned():
    # states written today must resume tomorrow: these values may never change (plain integer
    # arithmetic, no numpy generator whose stream could change between versions)
    assert permutation(12, round_keys(0, "pin")).tolist() == PINNED_12
    assert permutation(1000, round_keys(7, "pin"))[:8].tolist() == PINNED_1000


PINNED_12 = [4, 5, 0, 1, 2, 3, 8, 7, 10, 11, 6, 9]
PINNED_1000 = [366, 755, 86, 471, 152, 746, 17, 476]


def test_units_are_dealt_as_a_partition_that_changes_with_seed_and_epoch():
    total = 103
    for world_size in (1, 2, 5):
        shares = [Shuffle(3, 8).units(1, total, r, world_size).tolist() for r in range(world_size)]
        # every unit once, to exactly one rank
        assert sorted(sum(shares, [])) == list(range(total))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    first = Shuffle(3, 8).units(1, total, 0, 1).tolist()
    assert first != list(range(total))
    assert first != Shuffle(3, 8).units(2, total, 0, 1).tolist()  # another epoch, another order
    assert first != Shuffle(4, 8).units(1, total, 0, 1).tolist()  # another seed, another order
    assert first != Shuffle(3, 8, "web").units(1, total, 0, 1).tolist()  # another bucket
    # the window only groups the entries
    assert first == Shuffle(3, 2).units(1, total, 0, 1).tolist()

# -----------------------------------------------------------------------------
# 2. the shuffled walk against the oracle


def corpus_config(seed, tmp_path):
    rng = random.Random(f"shuffle-{seed}")
    world_size = rng.randint(1, 3)
    T, tbs = rng.randint(4, 24), rng.randint(1, 5)
    random_corpus(rng, tmp_path, T, world_size, tbs)
    cfg = dict(B=rng.randint(1, 4), T=T, tokenizer_batch_size=tbs,
               buffer_size=rng.choice([2, 5, 20]), rank=rng.randrange(world_size),
               world_size=world_size, data_dir=str(tmp_path), prefetch=0,
               shuffle=True, seed=rng.randint(0, 99), shuffle_window=rng.randint(1, 4))
    return cfg


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["bestfit", "concat"])
def test_shuffled_batches_match_the_oracle(kind, seed, tmp_path):
    cfg = corpus_config(seed, tmp_path)
    paths = split_parquet_files("train", str(tmp_path))
    docs = oracle.shuffled_document_batches(paths, cfg["tokenizer_batch_size"], cfg["rank"],
                                            cfg["world_size"], cfg["seed"], cfg["shuffle_window"])
    args = (ByteTokenizer(), paths, cfg["B"], cfg["T"], cfg["tokenizer_batch_size"])
    if kind == "bestfit":
        expected = oracle.bestfit_loader(*args, cfg["buffer_size"], batches=docs)
    else:
        expected = oracle.concat_loader(*args, batches=docs)
    loader = open_loader(kind, dict(cfg, split="train"))
    for k in range(300):
        inputs, targets, state = next(loader)
        want = next(expected)
        assert (inputs.tolist(), targets.tolist()) == (want[0], want[1]), f"batch {k}"
        if state["epoch"] >= 3:
            break
    assert state["epoch"] >= 3, "the run should cover two whole epochs"
    loader.close()


def test_entries_leave_file_order(tmp_path):
    # 300 documents numbered in file order: shuffled, about half of consecutive pairs increase, not
    # all
    write_shards(tmp_path, [[f"{i:03d}" for i in range(150)], [f"{i:03d}" for i in range(150, 300)],
                            ["v"]], 16)
    keys = []
    for shuffle in (False, True):
        loader = open_loader("bestfit", dict(B=4, T=4, tokenizer_batch_size=8, buffer_size=1,
                                             data_dir=str(tmp_path), prefetch=0,
                                             trace_documents=True), shuffle=shuffle)
        order = []
        while len(order) < 300:
            next(loader)
            order += [k for row in loader.documents for k in row]
        keys.append([k[1:] for k in order[:300]])
    increasing = [sum(a < b for a, b in zip(ks, ks[1:])) / (len(ks) - 1) for ks in keys]
    assert increasing[0] == 1.0 and 0.3 < increasing[1] < 0.7, increasing
    assert sorted(keys[1]) == sorted(keys[0])  # the same documents: one epoch, reordered

# -----------------------------------------------------------------------------
# 3. exact resume


@pytest.mark.parametrize("seed", slow_beyond(range(2), 1))
@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("kind", ["bestfit", "concat", "split_reuse"])
def test_exact_resume_after_every_batch(kind, prefetch, seed, tmp_path):
    cfg = dict(corpus_config(seed + 10, tmp_path), split="train", prefetch=prefetch,
               split_overlap=1)
    loader = open_loader(kind, cfg)
    run = take_across_epoch(loader, 300)
    loader.close()
    states = [s for _, _, s in run]
    assert states[0]["epoch"] < states[-1]["epoch"], "the run should cross an epoch boundary"
    assert any(s["next"][2] > 0 for s in states), "some state should stop mid window"
    assert len({s["next"][1] for s in states}) >= 2, "the run should cross a window boundary"
    assert all(len(s["next"]) == 3
               and s["config"]["shuffle"] == {"seed": cfg["seed"], "window": cfg["shuffle_window"]}
               for s in states)
    for k in range(len(run) - 1):
        resumed = open_loader(kind, cfg, resume_state_dict=json.loads(json.dumps(states[k])),
                              prefetch=prefetch if k % 2 else 3 - prefetch)
        assert take(resumed, len(run) - k - 1) == run[k + 1:], f"resumed after batch {k}"
        resumed.close()


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """Long documents as numbered words, pretokenized in windows (L=9, O=3), train and val."""
    root = tmp_path_factory.mktemp("windowed")
    rng = random.Random(1)
    files = [[" ".join(str(rng.randint(0, 9)) for _ in range(rng.choice([2, 5, 30, 60])))
              for _ in range(n)]
             for n in (70, 50, 10)]
    write_shards(root / "parquet", files, row_group_size=8)
    from nanochat.tokenizer import RustBPETokenizer
    tokenizer = RustBPETokenizer.train_from_iterator(iter(sum(files, [])), 270)
    tokenizer.save(str(root / "tokenizer"))
    assert pretokenize_main(["--input", str(root / "parquet"),
                             "--tokenizer-dir", str(root / "tokenizer"),
                             "--num-workers", "1", "--output", str(root / "tokens"),
                             "--max-length", "9", "--overlap-size", "3"]) == 0
    return root


@pytest.mark.slow
@pytest.mark.parametrize("policy,overlap", [("crop", 0), ("split_reuse", 2)])
def test_pretokenized_exact_resume(windowed, policy, overlap):
    kw = dict(device="cpu", buffer_size=6, data_dir=str(windowed / "tokens"), chunk_size=5,
              batch_size=3, rank=1, world_size=2, long_doc_policy=policy, split_overlap=overlap,
              prefetch=0, **SHUFFLED)
    run = take(PRETOKENIZED(2, 16, "train", **kw), 160)
    assert run[0][2]["epoch"] < run[-1][2]["epoch"]
    for k in (0, 7, 33, 90, 120, 150):
        resumed = PRETOKENIZED(2, 16, "train", resume_state_dict=json.loads(json.dumps(run[k][2])),
                               **kw)
        assert take(resumed, 160 - k - 1) == run[k + 1:], f"resumed after batch {k}"


def test_state_stays_small_with_a_full_buffer(tmp_path):
    rng = random.Random(4)
    docs = ["z" * rng.randint(0, 60) for _ in range(4000)]
    write_shards(tmp_path, [docs[:2000], docs[2000:], ["val"]], row_group_size=256)
    sizes = {}
    for shuffle in (False, True):
        loader = open_loader("bestfit", dict(B=8, T=64, buffer_size=1000, data_dir=str(tmp_path),
                                             prefetch=0),
                             shuffle=shuffle)
        state = take(loader, 20)[-1][2]
        assert 999 <= len(decode_keys(state["buffer"])) < 1000 + 128
        sizes[shuffle] = len(json.dumps(state))
    # measured: 2,941 bytes unshuffled, 2,950 shuffled: the buffered documents are named by their
    # position in their window's order, in which they arrived (named by place, rows of 8 row groups
    # interleaved, 14,622)
    print(f"state size with 1,000+ buffered documents: {sizes[False]:,} bytes unshuffled, "
          f"{sizes[True]:,} shuffled")
    assert sizes[True] < 2 * sizes[False] < 16 * 1024

# -----------------------------------------------------------------------------
# 4. elastic restarts


@pytest.mark.parametrize("n_old,n_new,k,tbs",
                         [(2, 3, 4, 3), (2, 3, 30, 3), (3, 2, 22, 3), (2, 3, 9, 1)])
def test_elastic_restart_places_every_document_once(n_old, n_new, k, tbs, tmp_path):
    elastic_corpus(tmp_path, seed=n_old * 100 + k)
    cfg = dict(B=2, T=20, tokenizer_batch_size=tbs, buffer_size=6, prefetch=0,
               data_dir=str(tmp_path), trace_documents=True, **SHUFFLED)
    texts, paths = texts_by_key(tmp_path), split_parquet_files("train", str(tmp_path))
    placed, states = [], []
    for r in range(n_old):
        loader = open_loader("bestfit", cfg, rank=r, world_size=n_old)
        for _ in range(k):
            batch = take(loader, 1)[0]
            check_rows_against_trace(batch, loader.documents, texts)
            placed += [key for row in loader.documents for key in row]
        states.append(batch[2])
    last_epoch = max(s["next"][0] for s in states)
    assert any(s["next"][2] > 0 for s in states), "some old rank should stop mid window"
    merged = merge_states(states, n_new, data_dir=str(tmp_path))
    assert [s["next"] for s in merged["states"]] == [[last_epoch + 1, 0, 0]] * n_new
    waiting = []
    for q in range(n_new):
        loader = open_loader("bestfit", cfg, rank=q, world_size=n_new, resume_state_dict=merged)
        for _ in range(500):
            batch = take(loader, 1)[0]
            check_rows_against_trace(batch, loader.documents, texts)
            placed += [key for row in loader.documents for key in row]
            old = [key for key in buffered_places(batch[2], paths) if key[0] <= last_epoch]
            if not batch[2]["plan"] and all(len(texts[key[1:]]) + 1 > cfg["T"] + 1
                                            for key in old):
                break
        else:
            pytest.fail(f"new rank {q} did not finish its plan in 500 batches")
        waiting += old
    counts = Counter([key for key in placed if key[0] <= last_epoch] + waiting)
    assert set(counts) == {(e, *key) for e in range(1, last_epoch + 1) for key in texts}
    assert [key for key, c in counts.items() if c != 1] == []


def test_chained_merges_and_exact_resume_mid_plan(tmp_path):
    # 2 ranks -> 3 that stop mid-plan -> 2: nothing lost or repeated; and every state of a new rank
    # working through its (shuffled) plan resumes exactly
    elastic_corpus(tmp_path, seed=7)
    cfg = dict(B=2, T=20, tokenizer_batch_size=3, buffer_size=6, prefetch=0,
               data_dir=str(tmp_path), trace_documents=True, **SHUFFLED)
    texts, paths = texts_by_key(tmp_path), split_parquet_files("train", str(tmp_path))
    placed, waiting, resume_from = [], [], None
    for world_size, k in ((2, 2), (3, 1), (2, None)):
        states = []
        for r in range(world_size):
            loader = open_loader("bestfit", cfg, rank=r, world_size=world_size,
                                 resume_state_dict=resume_from)
            run = []
            for _ in range(k or 500):
                run.append(take(loader, 1)[0])
                placed += [key for row in loader.documents for key in row]
                state = run[-1][2]
                old = ([key for key in buffered_places(state, paths) if key[0] <= last_epoch]
                       if k is None else [])
                if k is None and not state["plan"] and all(len(texts[key[1:]]) + 1 > 21
                                                           for key in old):
                    waiting += old
                    break
            states.append(state)
            # a new rank's plan: whole row groups (keyed order) and single documents
            if k is None:
                with_plan = [j for j, b in enumerate(run) if b[2]["plan"]]
                for j in with_plan[:6]:
                    again = open_loader("bestfit", cfg, rank=r, world_size=world_size,
                                        resume_state_dict=run[j][2])
                    assert take(again, 4) == run[j + 1:j + 5], f"rank {r}: resumed after batch {j}"
        if k is not None:
            if resume_from is not None:
                assert any(s["plan"] for s in states), "the middle ranks should stop mid-plan"
            last_epoch = max(s["next"][0] for s in states)
            resume_from = merge_states(states, 3 if world_size == 2 and resume_from is None else 2,
                                       data_dir=str(tmp_path))
    counts = Counter([key for key in placed if key[0] <= last_epoch] + waiting)
    assert set(counts) == {(e, *key) for e in range(1, last_epoch + 1) for key in texts}
    assert [key for key, c in counts.items() if c != 1] == []


# -----------------------------------------------------------------------------
# 5. mixture buckets


def mixture_dir(root):
    for split, seed in (("train", 1), ("val", 2)):
        for bucket, bucket_seed in (("web", 3), ("code", 4)):
            write_token_dir(root / split / bucket, seed * 10 + bucket_seed, n_docs=60)
    return str(root)


CURRICULUM = [{"tokens": 4000, "mix": {"web": 0.5, "code": 0.5}}]
MIX_KW = dict(device="cpu", buffer_size=4, chunk_size=8, batch_size=3, prefetch=0,
              allow_bucket_exhaustion=True, bos_token=BOS)


def test_mixture_buckets_shuffle_and_resume_exactly(tmp_path):
    data = mixture_dir(tmp_path)
    plain = take(MIX(2, 16, "train", CURRICULUM, data_dir=data, **MIX_KW), 30)
    run = take(MIX(2, 16, "train", CURRICULUM, data_dir=data, shuffle=True, seed=3, **MIX_KW),
               30)
    assert [b[0] for b in run] != [b[0] for b in plain]
    assert run[-1][2]["buckets"]["web"]["config"]["shuffle"] == {"seed": 3, "window": 8,
                                                                 "bucket": "web"}
    for k in (0, 9, 21):
        resumed = MIX(2, 16, "train", CURRICULUM, data_dir=data, shuffle=True, seed=3,
                      resume_state_dict=json.loads(json.dumps(run[k][2])), **MIX_KW)
        assert take(resumed, 30 - k - 1) == run[k + 1:], f"resumed after batch {k}"


def test_mixture_merges_deal_nothing_twice(tmp_path):
    # 2 ranks -> 3 -> 2 -> 2: a bucket is read once, however often its readers are merged (a merged
    # bucket's cursor points past its one epoch: nothing more is dealt); each document is placed
    # at most once
    data = mixture_dir(tmp_path)
    kw = dict(MIX_KW, data_dir=data, trace_documents=True, shuffle=True, seed=2, shuffle_window=2)
    placed, resume_from = [], None
    chain = [(2, 5), (3, 4), (2, 4), (2, 4)]
    for n, (world_size, steps) in enumerate(chain):
        states = []
        for rank in range(world_size):
            loader = MIX(2, 16, "train", CURRICULUM, rank=rank, world_size=world_size,
                         resume_state_dict=resume_from, **kw)
            for _ in range(steps):
                state = next(loader)[2]
                placed += [key for row in loader.documents for key in row]
            states.append(state)
        resume_from = merge_states(states, chain[n + 1][0] if n + 1 < len(chain) else 3,
                                   data_dir=data)
        assert all(item["epoch"] == 1 for s in resume_from["states"]
                   for b in s["buckets"].values()
                   for item in b["plan"]), "only the buckets' one pass is dealt"
    assert len(placed) > 100 and {key[1] for key in placed} == {1}
    assert len(placed) == len(set(placed)), "a document was dealt twice"


def test_a_changed_seed_is_refused_for_a_shuffled_mixture(tmp_path):
    data = mixture_dir(tmp_path)
    state = take(MIX(2, 16, "train", CURRICULUM, data_dir=data, shuffle=True, seed=3, **MIX_KW),
                 3)[-1][2]
    # no allow_state_mismatch offered
    with pytest.raises(ValueError, match=r"seed: state 3, loader 4\)$"):
        MIX(2, 16, "train", CURRICULUM, data_dir=data, shuffle=True, seed=4,
            resume_state_dict=state, **MIX_KW)

# -----------------------------------------------------------------------------
# 6. what a shuffled loader refuses, and what it resumes approximately


def test_refusals_and_another_ranks_state(tmp_path, caplog):
    elastic_corpus(tmp_path, seed=3)
    cfg = dict(B=2, T=20, tokenizer_batch_size=3, buffer_size=6, prefetch=0,
               data_dir=str(tmp_path), **SHUFFLED)
    state = take(open_loader("bestfit", cfg, rank=0, world_size=2), 5)[-1][2]
    with pytest.raises(ValueError,
                       match=r"shuffle: state \{'seed': 5, 'window': 2\}, loader \{'seed': 6"):
        open_loader("bestfit", cfg, rank=0, world_size=2, seed=6, resume_state_dict=state)
    with pytest.raises(ValueError, match="shuffle: state"):
        open_loader("bestfit", cfg, rank=0, world_size=2, shuffle=False, resume_state_dict=state)
    with pytest.raises(ValueError, match="not a state of this shuffled walk .nanochat's form."):
        open_loader("bestfit", cfg, rank=0, world_size=2,
                    resume_state_dict={"pq_idx": 0, "rg_idx": 0, "epoch": 1})
    with pytest.raises(ValueError,
                       match="cannot tell which documents were read under another order"):
        open_loader("bestfit", cfg, rank=0, world_size=2, seed=6, allow_state_mismatch=True,
                    resume_state_dict=state)
    # nor on other data, even with the same order's settings
    (tmp_path / "other").mkdir()
    elastic_corpus(tmp_path / "other", seed=4)
    with pytest.raises(ValueError, match=r"not a state of this shuffled walk \(files: state"):
        open_loader("bestfit", cfg, rank=1, world_size=2, data_dir=str(tmp_path / "other"),
                    allow_state_mismatch=True, resume_state_dict=state)
    for bad, match in ((dict(shuffle=1), "shuffle must be True or False"),
                       (dict(seed=1.5), "seed must be an integer"),
                       (dict(shuffle_window=0), "shuffle_window must be an integer >= 1")):
        with pytest.raises(ValueError, match=match):
            open_loader("bestfit", cfg, **bad)
    # nanochat's base_train hands rank 0's state to every rank: rank 1 resumes after rank 0's window
    approximate = take(open_loader("bestfit", cfg, rank=1, world_size=2, resume_state_dict=state),
                       3)
    assert ("another rank's state" in caplog.text
            and f"after its window {state['next'][1]}" in caplog.text)
    assert approximate[-1][2]["next"][:2] >= [state["next"][0], state["next"][1] + 1]

# -----------------------------------------------------------------------------
# 7. the windows of one document land far apart


def window_distances(root, shuffle: bool) -> list[int]:
    """For each pair of consecutive windows of one document: how many batches apart they were
    emitted."""
    loader = PRETOKENIZED(2, 16, "train", device="cpu", data_dir=str(root / "tokens"), chunk_size=8,
                          batch_size=8, buffer_size=8, prefetch=0, trace_documents=True,
                          shuffle=shuffle, seed=0, shuffle_window=16)
    shards = [TokenShard(p) for p in list_token_shards(str(root / "tokens" / "train"))]
    # a window with no overlap starts a document
    document = [np.cumsum(s.overlaps == 0) for s in shards]
    seen, distances = {}, []
    for step in range(200):
        state = next(loader)[2]
        if state["epoch"] > 1:
            break
        for row in loader.documents:
            for key in row:
                entry = key[2] * 8 + key[3]
                doc = (key[1], int(document[key[1]][entry]))
                if doc in seen and seen[doc][1] == entry - 1:
                    distances.append(step - seen[doc][0])
                seen[doc] = (step, entry)
    return distances


def test_windows_of_one_document_rarely_share_a_batch(windowed):
    plain, shuffled = window_distances(windowed, False), window_distances(windowed, True)
    same = [sum(d == 0 for d in ds) / len(ds) for ds in (plain, shuffled)]
    print(f"consecutive windows of one document in the same batch: {same[0]:.0%} in file order, "
          f"{same[1]:.0%} shuffled; median distance {np.median(plain):.0f} vs "
          f"{np.median(shuffled):.0f} batches")
    assert len(plain) > 50 and len(shuffled) > 50
    assert same[0] > 0.5 and same[1] < same[0] / 3


def test_validate_counts_each_ranks_shuffled_share(tmp_path, capsys):
    # a shuffled rank reads the chunks at its positions of the bucket's permutation: validate (the
    # CLI and the loader's start-up check) counts those, not chunks rank, rank + W, ... of every
    # file
    from nanochat.data.mixtures.curriculum import rank_shares
    from nanochat.mixture import main as mixture_main
    data = mixture_dir(tmp_path)
    paths = [p + ".bin" for p in list_token_shards(str(tmp_path / "train" / "web"))]
    chunks = []  # tokens of every chunk of 8 entries, file by file
    for path in paths:
        offsets = TokenShard(path).offsets
        chunks += [int(offsets[min(i + 8, len(offsets) - 1)] - offsets[i])
                   for i in range(0, len(offsets) - 1, 8)]
    order = Shuffle(3, 8, "web").units(1, len(chunks), 0, 1).tolist()
    expected = [sum(chunks[g] for g in order[r::3]) for r in range(3)]
    shuffled = rank_shares(paths, 8, 3, Shuffle(3, 8, "web"))
    assert shuffled == expected and sum(shuffled) == sum(chunks)
    # (for this seed) other chunks than file order deals
    assert shuffled != rank_shares(paths, 8, 3)
    config = tmp_path / "cur.json"
    config.write_text(json.dumps(CURRICULUM))
    args = ["validate", str(config), "--data", data, "--world-size", "3", "--chunk-size", "8"]
    assert mixture_main(args + ["--shuffle", "--seed", "3", "--allow-bucket-exhaustion"]) == 0
    web = [line for line in capsys.readouterr().out.splitlines() if " web " in line]
    assert web and web[0].split()[6].replace(",", "") == str(min(shuffled)), web

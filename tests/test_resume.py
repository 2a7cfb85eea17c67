"""
Exact and elastic resume (nanochat/resume.py and the version-2 states of nanochat/dataloader.py).

- exact resume after every batch of a run, on random corpora (uneven row groups, empty texts,
  documents longer than a row) and random shapes, ranks and world sizes, for both loaders, train
  and val, with and without the background threads: the same batches and the same states;
- the state is plain data (JSON and torch.load(weights_only=True)) and stays small;
- the emitted-token fingerprint, recomputed here from the yielded tensors;
- refused resumes (another split, dataset, shape, rank, version, a truncated or edited state),
  what allow_state_mismatch=True accepts instead, and nanochat's {pq_idx, rg_idx, epoch} form;
- statistics that continue across a resume;
- merge_states: its errors, and an elastic N -> M restart in one process where every document
  not yet trained on is placed exactly once (checked on document traces and on the tokens);
- every field checked: a hypothesis property edits real states of every loader (and states to
  merge) at random and recomputes their checksums: each resumes, or is refused with a ValueError
  naming the edited field, within a time and memory bound; and worked examples, field by field.
Run: python -m pytest tests/test_resume.py -q
"""

import contextlib
import copy
import hashlib
import io
import json
import random
import signal
import tracemalloc
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import event, given, settings, strategies as st

import oracle
from conftest import ByteTokenizer, slow_beyond, take, take_across_epoch, write_shard, write_shards
from nanochat.dataloader import (
    pretokenized_distributed_data_loader_with_state_bos_bestfit as PRETOKENIZED,
    tokenizing_distributed_data_loader_with_state,
    tokenizing_distributed_data_loader_with_state_bos_bestfit,
)
from nanochat.data.base.datasets import split_parquet_files
from nanochat.mixture import MixtureStop, pretokenized_mixture_loader_with_state_bos_bestfit as MIX
from nanochat.data.pretokenized.token_shards import write_token_shard
from nanochat.data.mixtures.mixture_state import add_mixture_checksum
from nanochat.data.loader.order import parquet_index
from nanochat.resume import merge_states
from nanochat.data.base.state import decode_keys, decode_plan, add_checksum

BESTFIT = tokenizing_distributed_data_loader_with_state_bos_bestfit
CONCAT = tokenizing_distributed_data_loader_with_state
BOS = ByteTokenizer.bos
V2_KEYS = ("version", "loader", "pq_idx", "rg_idx", "epoch", "plan", "next", "buffer", "offset",
           "config", "emitted", "counters", "checksum")

# -----------------------------------------------------------------------------
# helpers: corpora, loaders, runs


def random_text(rng: random.Random, T: int) -> str:
    """Empty (a lone BOS), longer than a row (T+1 tokens with BOS), or anything in between."""
    r = rng.random()
    n = 0 if r < 0.15 else rng.randint(T + 1, 3 * T) if r < 0.3 else rng.randint(1, T)
    return "".join(rng.choice("abcdefgh ") for _ in range(n))


def random_corpus(rng: random.Random, data_dir, T: int, world_size: int, tokenizer_batch_size: int):
    """2-3 train shards and a val shard (the last one). Row groups are longer than a tokenizer batch
    (so states land mid row group) and every rank gets at least three row groups of every file."""
    n_files = rng.randint(2, 3) + 1
    for i in range(n_files):
        rg = rng.randint(tokenizer_batch_size + 1, tokenizer_batch_size + 6)
        n = rng.randint(3 * world_size * rg, 3 * world_size * rg + 25)
        write_shard(data_dir / f"shard_{i:05d}.parquet", [random_text(rng, T) for _ in range(n)],
                    row_group_size=rg)


def open_loader(kind: str, cfg: dict, **over):
    """A loader of `kind` on cfg's data; over replaces any argument (concat ignores best-fit
    options). kind: "bestfit", "concat", or a long_doc_policy of the best-fit loader ("split",
    "split_reuse")."""
    kw = {"device": "cpu", **cfg, **over}
    B, T, split = kw.pop("B"), kw.pop("T"), kw.pop("split", "train")
    if kind == "concat":
        for option in ("buffer_size", "trace_documents", "split_overlap"):
            kw.pop(option, None)
        return CONCAT(ByteTokenizer(), B, T, split, **kw)
    if kind in ("split", "split_reuse"):
        kw["long_doc_policy"] = kind
    else:
        kw.pop("split_overlap", None)
    return BESTFIT(ByteTokenizer(), B, T, split, **kw)


def rows_of(batch) -> list[list[int]]:
    """Best-fit: the B rows of T+1 tokens a batch was sliced from."""
    inputs, targets = batch[0], batch[1]
    return [x + [y[-1]] for x, y in zip(inputs, targets)]


def flat_of(batch) -> list[int]:
    """Concatenation: the B*T+1 tokens of the stream a batch was cut from (its last is the next
    batch's first)."""
    inputs, targets = batch[0], batch[1]
    return [t for row in inputs for t in row] + [targets[-1][-1]]


def stream_of(batches) -> list[int]:
    """Concatenation: the stream consecutive batches were cut from: every batch's inputs, then the
    last batch's last target."""
    return [t for b in batches for row in b[0] for t in row] + [batches[-1][1][-1][-1]]


def emitted_tokens(kind: str, batch) -> list[int]:
    return [t for row in rows_of(batch) for t in row] if kind == "bestfit" else flat_of(batch)


def sha_chain(previous: str, tokens: list[int]) -> str:
    """The documented fingerprint, written independently: sha256(previous digest || tokens as uint32
    little-endian), truncated to 128 bits (32 hex digits)."""
    h = hashlib.sha256(bytes.fromhex(previous))
    h.update(np.asarray(tokens, dtype="<u4").tobytes())
    return h.hexdigest()[:32]


def texts_by_key(data_dir, split="train"):
    """(pq_idx, rg_idx, row) -> text, for every document of the split."""
    texts = {}
    for p, path in enumerate(split_parquet_files(split, str(data_dir))):
        pf = pq.ParquetFile(path)
        for g in range(pf.num_row_groups):
            for r, text in enumerate(pf.read_row_group(g).column("text").to_pylist()):
                texts[(p, g, r)] = text
    return texts


def check_rows_against_trace(batch, trace, texts):
    """Each row splits at BOS into exactly the traced documents: all whole but the last, which may
    be cropped (a prefix of its document)."""
    rows = rows_of(batch)
    assert len(trace) == len(rows)
    for row, keys in zip(rows, trace):
        starts = [i for i, t in enumerate(row) if t == BOS]
        assert starts[0] == 0 and len(starts) == len(keys)
        for n, (start, key) in enumerate(zip(starts, keys)):
            end = starts[n + 1] if n + 1 < len(starts) else len(row)
            doc = [BOS] + list(texts[key[1:]].encode())
            if n + 1 < len(starts):
                assert row[start:end] == doc
            else:
                assert row[start:end] == doc[:end - start]


SMALL = dict(B=2, T=16, tokenizer_batch_size=4, buffer_size=5, rank=0, world_size=1, prefetch=0)


def write_small(data_dir) -> dict:
    """3 train shards (row groups of 6, 5 and 7) and a val shard: texts of 0 to 40 characters."""
    rng = random.Random(11)
    data_dir.mkdir(parents=True, exist_ok=True)
    for i, (n, rg) in enumerate([(40, 6), (33, 5), (45, 7), (30, 6)]):
        texts = ["".join(rng.choice("pqrstu ") for _ in range(rng.randint(0, 40)))
                 for _ in range(n)]
        write_shard(data_dir / f"shard_{i:05d}.parquet", texts, row_group_size=rg)
    return dict(SMALL, data_dir=str(data_dir))


@pytest.fixture
def small(tmp_path):
    return write_small(tmp_path)


# -----------------------------------------------------------------------------
# 1. exact resume after every batch


@pytest.mark.parametrize("seed", slow_beyond(range(3), 1))
@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("split", ["train", "val"])
@pytest.mark.parametrize("kind", ["bestfit", "concat", "split", "split_reuse"])
def test_exact_resume_after_every_batch(kind, split, prefetch, seed, tmp_path):
    # (the random seeds of the policy kinds start at 10: their configs cover the cases below)
    rng = random.Random(
        f"{kind}-{split}-{prefetch}-{seed + 10 * (kind in ('split', 'split_reuse'))}")
    world_size = rng.randint(1, 3)
    T, tbs = rng.randint(4, 32), rng.randint(1, 5)
    random_corpus(rng, tmp_path, T, world_size, tbs)
    cfg = dict(B=rng.randint(1, 4), T=T, split=split, tokenizer_batch_size=tbs,
               buffer_size=rng.choice([2, 3, 7, 20]), rank=rng.randrange(world_size),
               world_size=world_size, prefetch=prefetch, data_dir=str(tmp_path),
               split_overlap=rng.choice([0, rng.randint(0, T - 1)]))
    loader = open_loader(kind, cfg)
    run = take_across_epoch(loader, 400)
    loader.close()
    states = [s for _, _, s in run]
    n = len(run)

    # the run covers what a resume must survive (a small val split may start epoch 2 in the first
    # batch)
    assert states[0]["epoch"] < states[-1]["epoch"], "the run should cross an epoch boundary"
    assert any(s["next"][3] > 0 for s in states), "some state should stop mid row group"
    assert any(s["next"][2] > cfg["rank"] for s in states), "some state should stop mid file"
    if split == "train":
        assert len({s["next"][1] for s in states}) >= 2, "the run should cross a file boundary"
    assert all(s["plan"] == [] for s in states)
    if kind == "concat":
        assert any(s["buffer"] and s["offset"] > 0 for s in states), (
            "some state should hold a started document")
    else:
        assert all(len(decode_keys(s["buffer"])) >= cfg["buffer_size"] - 1 for s in states)
    if kind in ("split", "split_reuse") and split == "train":  # (a val run may be a few batches)
        assert any(s["pieces"] for s in states), "some state should hold pieces of a split document"

    for k in range(n - 1):
        # every other resume swaps the background threads on or off: prefetch is not part of the
        # stream
        resumed = open_loader(kind, cfg, resume_state_dict=states[k],
                              prefetch=prefetch if k % 2 else 3 - prefetch)
        for j in range(k + 1, n):
            inputs, targets, state = next(resumed)
            assert (inputs.tolist(), targets.tolist()) == run[j][:2], (
                f"resumed after batch {k}: batch {j} differs")
            assert state == states[j], f"resumed after batch {k}: state {j} differs"
        resumed.close()


def test_resume_of_a_resume_and_from_the_first_state(small):
    # a state yielded by a resumed loader resumes as well as one from the uninterrupted run
    run = take(open_loader("bestfit", small), 12)
    first = open_loader("bestfit", small, resume_state_dict=run[0][2])
    again = take(first, 4)
    second = open_loader("bestfit", small, resume_state_dict=again[-1][2])
    assert take(second, 7) == run[5:12]


# -----------------------------------------------------------------------------
# 2. the state is plain data, and small


@pytest.mark.parametrize("kind", ["bestfit", "concat"])
def test_state_survives_json_and_torch(kind, small):
    run = take(open_loader(kind, small), 14)
    k = 6
    state = run[k][2]
    assert state["buffer"] and sorted(state) == sorted(V2_KEYS + ("pieces",))
    via_json = json.loads(json.dumps(state))
    assert via_json == state
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    via_torch = torch.load(buffer, weights_only=True)
    assert via_torch == state
    for restored in (via_json, via_torch):
        assert take(open_loader(kind, small, resume_state_dict=restored), 14 - k - 1) == run[k + 1:]


def test_state_is_a_few_kb_with_a_full_buffer(tmp_path):
    rng = random.Random(4)
    docs = ["z" * rng.randint(0, 60) for _ in range(4000)]
    write_shards(tmp_path, [docs[:2000], docs[2000:], ["val"]], row_group_size=256)
    loader = BESTFIT(ByteTokenizer(), 8, 64, "train", device="cpu", buffer_size=1000,
                     data_dir=str(tmp_path), prefetch=0)
    for _ in range(20):
        _, _, state = next(loader)
    assert 999 <= len(decode_keys(state["buffer"])) < 1000 + 128
    size = len(json.dumps(state))
    # measured: 3,322 bytes with 1,039 buffered documents (after 20 batches of 8x64)
    print(f"state size: {size} bytes, {len(decode_keys(state['buffer']))} buffered documents")
    assert size < 16 * 1024


# -----------------------------------------------------------------------------
# 3. the emitted-token fingerprint


@pytest.mark.parametrize("kind", ["bestfit", "concat"])
def test_emitted_fingerprint(kind, small, tmp_path):
    B, T = small["B"], small["T"]
    run = take(open_loader(kind, small), 15)
    digest = "0" * 32
    for j, batch in enumerate(run, start=1):
        emitted = batch[2]["emitted"]
        digest = sha_chain(digest, emitted_tokens(kind, batch))
        assert emitted["hash"] == digest
        assert emitted["batches"] == j
        assert emitted["tokens"] == j * (B * (T + 1) if kind == "bestfit" else B * T + 1)
    hashes = [batch[2]["emitted"]["hash"] for batch in run]
    assert len(set(hashes)) == len(hashes)  # it changes with every batch

    # a resumed run continues the fingerprint
    resumed = take(open_loader(kind, small, resume_state_dict=run[4][2]), 10)
    assert [b[2]["emitted"] for b in resumed] == [b[2]["emitted"] for b in run[5:]]

    # other data, same shapes: another fingerprint from the first batch on
    other = tmp_path / "other"
    write_shards(other, [["another corpus entirely"] * 30, ["v"]], row_group_size=5)
    elsewhere = take(open_loader(kind, small, data_dir=str(other)), 3)
    assert all(a[2]["emitted"]["hash"] != b[2]["emitted"]["hash"] for a, b in zip(elsewhere, run))


# -----------------------------------------------------------------------------
# 4. refused resumes, and what allow_state_mismatch=True accepts instead


def state_after(kind: str, cfg: dict, k: int, **over) -> dict:
    loader = open_loader(kind, cfg, **over)
    state = take(loader, k)[-1][2]
    loader.close()
    return state


@pytest.mark.parametrize("kind", ["bestfit", "concat"])
@pytest.mark.parametrize("field,taken,resumed", [
    ("B", {}, {"B": 3}),
    ("T", {}, {"T": 12}),
    # not only another rank
    ("B", {"rank": 0, "world_size": 2}, {"B": 3, "rank": 1, "world_size": 2}),
    ("tokenizer_batch_size", {}, {"tokenizer_batch_size": 3}),
    ("split", {"split": "val"}, {"split": "train"}),
])
def test_refused_on_another_configuration(kind, field, taken, resumed, small):
    state = state_after(kind, small, 3, **taken)
    old, new = {"split": "train", **small, **taken}, {"split": "train", **small, **resumed}
    with pytest.raises(ValueError, match=f"{field}: state {old[field]!r}, loader {new[field]!r}"):
        open_loader(kind, small, resume_state_dict=state, **resumed)


def test_refused_on_another_buffer_size_loader_or_tokenizer(small):
    state = state_after("bestfit", small, 3)
    with pytest.raises(ValueError, match="buffer_size: state 5, loader 6"):
        open_loader("bestfit", small, resume_state_dict=state, buffer_size=6)
    with pytest.raises(ValueError, match="loader: state 'bestfit', loader 'concat'"):
        open_loader("concat", small, resume_state_dict=state)
    # a state without the policies' fields (no pieces; its config has neither policy field) reads
    # as "crop"
    no_policy = {k: v for k, v in state.items() if k != "pieces"}
    no_policy["config"] = {k: v for k, v in state["config"].items()
                           if k not in ("long_doc_policy", "split_overlap")}
    no_policy = add_checksum(no_policy)
    assert take(open_loader("bestfit", small, resume_state_dict=no_policy), 2) == take(
        open_loader("bestfit", small, resume_state_dict=state), 2)
    with pytest.raises(ValueError, match="long_doc_policy: state 'crop', loader 'split'"):
        open_loader("split", small, resume_state_dict=no_policy)
    with pytest.raises(ValueError, match="split_overlap: state 2, loader 1"):
        open_loader("split", small,
                    resume_state_dict=state_after("split", small, 3, split_overlap=2),
                    split_overlap=1)

    class Shifted(ByteTokenizer):
        def encode(self, texts, prepend=None, num_threads=1):
            return [[t if t == prepend else (t + 1) % 256 for t in ids]
                    for ids in super().encode(texts, prepend)]

    with pytest.raises(ValueError, match="tokenizer: state '[0-9a-f]+', loader '[0-9a-f]+'"):
        BESTFIT(Shifted(), 2, 16, "train", 4, 4, "cpu", state, 5, data_dir=small["data_dir"],
                rank=0, world_size=1)


@pytest.mark.parametrize("kind", ["bestfit", "concat"])
def test_refused_on_another_dataset(kind, small, tmp_path):
    state = state_after(kind, small, 3)
    other = tmp_path / "other"
    write_shards(other, [["a different shard"] * 40, ["and another"] * 33, ["v"] * 4],
                 row_group_size=6)
    with pytest.raises(ValueError, match="files: state '[0-9a-f]{32}', loader '[0-9a-f]{32}'"):
        open_loader(kind, small, resume_state_dict=state, data_dir=str(other))


@pytest.mark.parametrize("version", [1, 99, "2", None])
def test_refused_on_another_version(version, small):
    state = dict(state_after("bestfit", small, 3), version=version)
    with pytest.raises(ValueError, match=r"\['version'\]"):
        open_loader("bestfit", small, resume_state_dict=state)


@pytest.mark.parametrize("key", V2_KEYS)
def test_refused_when_truncated(key, small):
    state = state_after("bestfit", small, 3)
    del state[key]
    with pytest.raises(ValueError, match=repr(key)):
        open_loader("bestfit", small, resume_state_dict=state)


@pytest.mark.parametrize("edit", [
    lambda s: s["buffer"][0][3].__setitem__(0, s["buffer"][0][3][0] + 1),
    lambda s: s["next"].__setitem__(3, s["next"][3] + 1),
    lambda s: s["next"].__setitem__(2, s["next"][2] + 1),
    lambda s: s["emitted"].__setitem__("batches", 0),
    lambda s: s["counters"].__setitem__("tokens_out", 1),
    lambda s: s.__setitem__("offset", 1),
])
def test_refused_when_edited(edit, small):
    state = copy.deepcopy(state_after("bestfit", small, 3))
    edit(state)
    with pytest.raises(ValueError, match=r"\['checksum'\] does not match"):
        open_loader("bestfit", small, resume_state_dict=state)


@pytest.mark.parametrize("state", [[1, 2], "{\"version\": 2}", 3, ("pq_idx", 0)])
def test_refused_when_not_a_dict(state, small):
    with pytest.raises(TypeError, match="resume_state_dict must be a dict"):
        open_loader("bestfit", small, resume_state_dict=state)


@pytest.mark.parametrize("kind", ["bestfit", "concat"])
@pytest.mark.parametrize("B", [1, 3])
def test_mismatched_B_continues_the_same_rows(kind, B, small):
    # rows (best-fit) and the token stream (concatenation) do not depend on B: a state taken with
    # B=2 and accepted with another B continues them exactly, only grouped differently
    run = take(open_loader(kind, small), 16)
    resumed = take(open_loader(kind, small, resume_state_dict=run[3][2], B=B,
                               allow_state_mismatch=True), 6)
    if kind == "bestfit":
        assert [r for b in resumed for r in rows_of(b)] == [
            r for b in run[4:] for r in rows_of(b)][:6 * B]
    else:
        old, new = stream_of(run[4:]), stream_of(resumed)
        assert len(new) == 6 * B * small["T"] + 1 <= len(old) and new == old[:len(new)]
    assert [b[2]["emitted"]["batches"] for b in resumed] == list(range(5, 11))
    assert resumed[0][2]["next"] >= run[3][2]["next"]


def test_mismatched_T_continues_the_same_documents(small):
    texts = texts_by_key(small["data_dir"])
    traced = dict(small, trace_documents=True)
    loader = open_loader("bestfit", traced)
    placed_before = []
    for _ in range(5):
        batch = take(loader, 1)[0]
        placed_before += [key for row in loader.documents for key in row]
    state = batch[2]
    buffered = decode_keys(state["buffer"])
    T = 24
    resumed = open_loader("bestfit", traced, T=T, resume_state_dict=state,
                          allow_state_mismatch=True)
    fresh = open_loader("bestfit", small, T=T)
    placed_after = []
    for j in range(8):
        batch = take(resumed, 1)[0]
        if j == 0:
            assert batch[:2] != take(fresh, 1)[0][:2], (
                "a mismatched resume must not restart from the beginning")
        check_rows_against_trace(batch, resumed.documents, texts)
        placed_after += [key for row in resumed.documents for key in row]
    # every document placed after the resume was buffered in the state or comes at or after its
    # cursor
    later = [key for key in placed_after if key not in buffered]
    assert all(key >= tuple(state["next"]) for key in later)
    assert not set(placed_after) & set(placed_before)
    # the buffered documents were not dropped: the new loader places them
    assert len(set(placed_after) & set(buffered)) >= len(buffered) // 2 > 0


@pytest.mark.parametrize("allow", [False, True])
@pytest.mark.parametrize("taken", [{}, {"rank": 0, "world_size": 2}])
@pytest.mark.parametrize("kind", ["bestfit", "concat"])
def test_another_ranks_state_resumes_approximately(kind, taken, allow, small, caplog):
    # nanochat's base_train saves rank 0's state alone and gives it to every rank when it resumes:
    # a rank (or world size) other than the state's resumes as nanochat's loader does, with a
    # warning
    state = json.loads(json.dumps(state_after(kind, small, 8, **taken)))
    assert (state["pq_idx"], state["rg_idx"]) != (0, 0)
    new = dict(rank=1, world_size=2)
    accepted = take(open_loader(kind, small, resume_state_dict=state, allow_state_mismatch=allow,
                                **new), 5)
    nanochat_form = {k: state[k] for k in ("pq_idx", "rg_idx", "epoch")}
    assert accepted == take(open_loader(kind, small, resume_state_dict=nanochat_form, **new), 5)
    assert accepted[0][:2] != take(open_loader(kind, small, **new), 1)[0][:2]
    if not allow:
        assert "another rank's state (rank: state 0, loader 1" in caplog.text


def test_edited_state_accepted_only_when_allowed(small):
    run = take(open_loader("bestfit", small), 8)
    state = copy.deepcopy(run[3][2])
    state["emitted"]["batches"] = 100  # edited: the checksum no longer matches
    with pytest.raises(ValueError, match="checksum"):
        open_loader("bestfit", small, resume_state_dict=state)
    resumed = take(open_loader("bestfit", small, resume_state_dict=state,
                               allow_state_mismatch=True), 4)
    assert [b[:2] for b in resumed] == [b[:2] for b in run[4:]]
    assert [b[2]["emitted"]["batches"] for b in resumed] == [101, 102, 103, 104]


# -----------------------------------------------------------------------------
# 5. nanochat's form {pq_idx, rg_idx[, epoch]}


@pytest.mark.parametrize("with_epoch", [True, False])
@pytest.mark.parametrize("kind", ["bestfit", "concat"])
@pytest.mark.parametrize("seed", range(3))
def test_nanochat_form_matches_the_oracle(seed, kind, with_epoch, tmp_path):
    rng = random.Random(f"seeds-{seed}-{kind}")
    world_size = rng.randint(1, 2)
    T, tbs = rng.randint(4, 24), rng.randint(1, 4)
    random_corpus(rng, tmp_path, T, world_size, tbs)
    cfg = dict(B=rng.randint(1, 3), T=T, tokenizer_batch_size=tbs,
               buffer_size=rng.choice([1, 4, 9]), rank=rng.randrange(world_size),
               world_size=world_size, prefetch=rng.choice([0, 2]), data_dir=str(tmp_path))
    paths = split_parquet_files("train", str(tmp_path))
    state = state_after(kind, cfg, rng.randint(1, 12))
    nanochat_form = {k: state[k] for k in (("pq_idx", "rg_idx", "epoch") if with_epoch
                                           else ("pq_idx", "rg_idx"))}
    resumed = take(open_loader(kind, cfg, resume_state_dict=nanochat_form), 6)
    args = (ByteTokenizer(), paths, cfg["B"], T, tbs)
    if kind == "bestfit":
        reference = oracle.bestfit_loader(*args, cfg["buffer_size"], cfg["rank"], world_size,
                                          resume=nanochat_form)
    else:
        reference = oracle.concat_loader(*args, cfg["rank"], world_size, resume=nanochat_form)
    for batch, (inputs, targets, expected) in zip(resumed, reference):
        assert batch[:2] == (inputs, targets)
        assert {k: batch[2][k] for k in ("pq_idx", "rg_idx", "epoch")} == expected
        assert batch[2]["version"] == 2  # and it yields version-2 states from then on


# -----------------------------------------------------------------------------
# 6. statistics continue across a resume


@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("kind", ["bestfit", "concat", "split", "split_reuse"])
def test_stats_continue_across_a_resume(kind, prefetch, small):
    cfg = dict(small, prefetch=prefetch, split_overlap=2)
    loader = open_loader(kind, cfg)
    stats, states = [], []
    for _ in range(16):
        states.append(take(loader, 1)[0][2])
        stats.append({k: v for k, v in loader.stats.items() if k != "wait_seconds"})
    last = stats[-1]
    assert (last["tokens_tokenized"]
            > last["tokens_emitted"] - last["tokens_bos_added"] - last["tokens_repeated"] > 0
            if kind != "concat" else last["tokens_tokenized"] > last["tokens_emitted"] > 0)
    if kind == "bestfit":
        assert stats[-1]["tokens_cropped"] > 0 and stats[-1]["buffer_docs"] >= 4
    if kind in ("split", "split_reuse"):
        assert stats[-1]["docs_split"] > 0 and stats[-1]["tokens_repeated"] > 0
    for k in (0, 5, 9):
        resumed = open_loader(kind, cfg, resume_state_dict=states[k])
        for j in range(k + 1, 16):
            next(resumed)
            assert {n: v for n, v in resumed.stats.items()
                    if n != "wait_seconds"} == stats[j], (k, j)
            assert resumed.stats["wait_seconds"] >= 0
        resumed.close()


# -----------------------------------------------------------------------------
# 7. merge_states: errors, and an elastic restart in one process


def rank_states(kind: str, cfg: dict, world_size: int, k: int, **over) -> list[dict]:
    return [state_after(kind, cfg, k, rank=r, world_size=world_size, **over)
            for r in range(world_size)]


def test_merge_errors(small):
    d = small["data_dir"]
    s0, s1 = rank_states("bestfit", small, 2, 3)
    later1 = state_after("bestfit", small, 4, rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"emitted\.batches"):
        merge_states([s0, later1], 3, data_dir=d)
    with pytest.raises(ValueError, match=r"config\.rank"):
        merge_states([s0, s0], 3, data_dir=d)
    t0, t1, _ = rank_states("bestfit", small, 3, 3)
    with pytest.raises(ValueError, match=r"config\.rank"):
        merge_states([t0, t1, t1], 2, data_dir=d)  # rank 2 missing, rank 1 twice
    with pytest.raises(ValueError, match=r"config\.world_size"):
        merge_states([s0], 3, data_dir=d)
    with pytest.raises(ValueError, match=r"config\.world_size"):
        merge_states([s0, s1, s0], 3, data_dir=d)
    other_B = state_after("bestfit", small, 3, rank=1, world_size=2, B=3)
    with pytest.raises(ValueError, match=r"config\.B"):
        merge_states([s0, other_B], 3, data_dir=d)
    concat1 = state_after("concat", small, 3, rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"config\.loader"):
        merge_states([s0, concat1], 3, data_dir=d)
    split1 = state_after("split", small, 3, rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"config\.long_doc_policy: states\[1\] has 'split', "
                                         r"states\[0\] has 'crop'"):
        merge_states([s0, split1], 3, data_dir=d)
    bad_pieces = add_checksum(dict(split1, pieces=[[10**6, 3]]))
    with pytest.raises(ValueError, match=r"states\[1\]\['pieces'\]"):
        merge_states([state_after("split", small, 3, rank=0, world_size=2), bad_pieces], 3,
                     data_dir=d)
    with pytest.raises(ValueError, match=r"resume_state_dict\['pieces'\]"):
        open_loader("split", small, resume_state_dict=add_checksum(
            dict(state_after("split", small, 3), pieces=[[0, -1]])))
    edited = copy.deepcopy(s1)
    edited["next"][3] += 1
    with pytest.raises(ValueError, match=r"states\[1\]\['checksum'\]"):
        merge_states([s0, edited], 3, data_dir=d)
    with pytest.raises(ValueError, match="version"):
        merge_states([s0, {"pq_idx": 0, "rg_idx": 1, "epoch": 1}], 3, data_dir=d)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        merge_states([s0, s1], 0, data_dir=d)

    merged = merge_states([s1, s0], 3, data_dir=d)  # any order
    assert (merged["merged"] == {"from_world_size": 2, "world_size": 3}
            and len(merged["states"]) == 3)
    with pytest.raises(ValueError, match="merged state"):
        merge_states([merged], 3, data_dir=d)
    with pytest.raises(ValueError, match="merged state"):
        merge_states([merged, merged], 3, data_dir=d)
    for world_size in (2, 4):
        with pytest.raises(ValueError, match="world size"):
            open_loader("bestfit", small, resume_state_dict=merged, rank=0, world_size=world_size)
    # the merge is plain data too
    assert json.loads(json.dumps(merged)) == merged


def test_merge_refuses_other_data(small, tmp_path):
    states = rank_states("bestfit", small, 2, 3)
    other = tmp_path / "other"
    write_shards(other, [["x"] * 10, ["y"] * 10], row_group_size=2)
    with pytest.raises(ValueError, match=r"config\.files"):
        merge_states(states, 3, data_dir=str(other))


def elastic_corpus(data_dir, seed: int):
    """3 train shards, each with at least 6 row groups (every one of 3 ranks reads two per file)."""
    rng = random.Random(seed)
    for i, rg in enumerate([5, 4, 6, 3]):
        n = 3 if i == 3 else rng.randint(6 * rg, 6 * rg + 7)
        texts = [random_text(rng, 20) for _ in range(n)]
        write_shard(data_dir / f"shard_{i:05d}.parquet", texts, row_group_size=rg)


@pytest.mark.parametrize("n_old,n_new,k,tbs", [(2, 3, 4, 3), (2, 3, 30, 3), (3, 2, 5, 3),
                                                (3, 2, 22, 3), (1, 2, 8, 1), (2, 2, 7, 2),
                                                (2, 3, 9, 1), (3, 3, 7, 1)])
def test_elastic_restart_places_every_document_once(n_old, n_new, k, tbs, tmp_path):
    elastic_corpus(tmp_path, seed=n_old * 100 + k)
    cfg = dict(B=2, T=20, tokenizer_batch_size=tbs, buffer_size=6, prefetch=0,
               data_dir=str(tmp_path), trace_documents=True)
    texts = texts_by_key(tmp_path)
    placed = []
    states = []
    for r in range(n_old):
        loader = open_loader("bestfit", cfg, rank=r, world_size=n_old)
        for _ in range(k):
            batch = take(loader, 1)[0]
            check_rows_against_trace(batch, loader.documents, texts)
            placed += [key for row in loader.documents for key in row]
        states.append(batch[2])
        loader.close()
    last_epoch = max(s["next"][0] for s in states)
    if tbs == 1:
        assert any(s["next"][3] == 1 for s in states), "some old rank should stop after row 0"

    merged = merge_states(states, n_new, data_dir=str(tmp_path))
    assert [s["next"] for s in merged["states"]] == [[last_epoch + 1, 0, q, 0]
                                                     for q in range(n_new)]
    assert all(s["plan"] for s in merged["states"])
    row_capacity = cfg["T"] + 1
    waiting = []  # documents still buffered at the end: each will be placed by its own rank only
    new_placed = []
    for q in range(n_new):
        loader = open_loader("bestfit", cfg, rank=q, world_size=n_new, resume_state_dict=merged)
        start = len(placed)
        for j in range(500):
            batch = take(loader, 1)[0]
            check_rows_against_trace(batch, loader.documents, texts)
            placed += [key for row in loader.documents for key in row]
            state = batch[2]
            if j == 0:
                assert state["emitted"]["batches"] == k + 1 and state["config"]["rank"] == q
            # best-fit crops a document longer than a row only when the buffer holds nothing
            # shorter, so those may wait indefinitely; everything else of the dealt work must have
            # been placed
            old = [key for key in decode_keys(state["buffer"]) if key[0] <= last_epoch]
            if not state["plan"] and all(len(texts[key[1:]]) + 1 > row_capacity for key in old):
                break
        else:
            pytest.fail(f"new rank {q} did not finish its plan in 500 batches")
        waiting += old
        new_placed.append(placed[start:])
        loader.close()

    # every document of epochs 1..last_epoch: placed exactly once, by an old rank or a new one (or
    # still waiting in exactly one new rank's buffer)
    counts = Counter([key for key in placed if key[0] <= last_epoch] + waiting)
    expected = {(e, *key) for e in range(1, last_epoch + 1) for key in texts}
    assert set(counts) == expected
    assert [key for key, c in counts.items() if c != 1] == []
    assert all(any(key[0] <= last_epoch for key in trace) for trace in new_placed), (
        "each new rank had work")
    if k >= 20:
        assert last_epoch >= 2, "the long case should merge after epoch 1"


@pytest.mark.parametrize("chain", [((2, 2), (3, 2), (2, None)), ((3, 4), (2, 2), (3, None)),
                                   ((1, 12), (3, 1), (1, None))])
def test_chained_merges_place_every_document_once(chain, tmp_path):
    # 2 ranks, merged for 3 that stop mid-plan, merged again for 2: the plans of a merged state are
    # dealt again, and nothing is lost or repeated
    elastic_corpus(tmp_path, seed=len(chain) + chain[0][1])
    cfg = dict(B=2, T=20, tokenizer_batch_size=3, buffer_size=6, prefetch=0, data_dir=str(tmp_path),
               trace_documents=True)
    texts = texts_by_key(tmp_path)
    placed, waiting, resume_from = [], [], None
    for world_size, k in chain:
        states = []
        for r in range(world_size):
            loader = open_loader("bestfit", cfg, rank=r, world_size=world_size,
                                 resume_state_dict=resume_from)
            for j in range(k or 500):
                batch = take(loader, 1)[0]
                placed += [key for row in loader.documents for key in row]
                state = batch[2]
                old = ([key for key in decode_keys(state["buffer"]) if key[0] <= last_epoch]
                       if k is None else [])
                if k is None and not state["plan"] and all(
                        len(texts[key[1:]]) + 1 > 21 for key in old):
                    waiting += old
                    break
            else:
                assert k is not None, (
                    f"rank {r} of {world_size} did not finish its plan in 500 batches")
            states.append(state)
            loader.close()
        if k is not None:
            if resume_from is not None:
                assert any(s["plan"] for s in states), "the middle ranks should stop mid-plan"
            last_epoch = max(s["next"][0] for s in states)
            resume_from = merge_states(states, chain[chain.index((world_size, k)) + 1][0],
                                       data_dir=str(tmp_path))
    counts = Counter([key for key in placed if key[0] <= last_epoch] + waiting)
    assert set(counts) == {(e, *key) for e in range(1, last_epoch + 1) for key in texts}
    assert [key for key, c in counts.items() if c != 1] == []


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [0, 3])
def test_exact_resume_mid_plan(prefetch, tmp_path):
    # a new rank's states while it works through its plan (rows of row groups, then whole row
    # groups) resume exactly, like any other
    elastic_corpus(tmp_path, seed=9)
    cfg = dict(B=1, T=20, tokenizer_batch_size=2, buffer_size=3, prefetch=prefetch,
               data_dir=str(tmp_path))
    merged = merge_states(rank_states("bestfit", cfg, 2, 5), 3, data_dir=str(tmp_path))
    for q in range(3):
        run = take(open_loader("bestfit", cfg, rank=q, world_size=3, resume_state_dict=merged), 40)
        states = [b[2] for b in run]
        with_plan = [k for k, s in enumerate(states) if s["plan"]]
        assert len(with_plan) >= 3 and with_plan[-1] < 35, "the run should work through its plan"
        assert any("row_groups" in item for s in states for item in s["plan"])
        assert any("rows" in item for s in states for item in s["plan"])
        for k in with_plan + [with_plan[-1] + 1]:
            resumed = open_loader("bestfit", cfg, rank=q, world_size=3, resume_state_dict=states[k])
            assert take(resumed, 40 - k - 1) == run[k + 1:], f"rank {q}: resumed after batch {k}"
            resumed.close()


def concat_entries(state, q: int, world_size: int, paths, texts, epochs: int) -> list[tuple]:
    """Rank q's concatenated stream, written out as (document key, start) entries (start None: the
    whole document): a merged state's plan, then the regular stream from its cursor (a fresh rank's:
    from the start), per epoch row groups q, q + world_size, ... of every file, up to `epochs`."""
    num_rows = Counter(key[:2] for key in texts)  # (pq_idx, rg_idx) -> rows
    entries = []
    if state is not None:
        for e, p, g, rows, starts in decode_plan(state["plan"], parquet_index(paths)):
            rows = range(num_rows[p, g]) if rows is None else rows
            entries += [((e, p, g, r), start)
                        for r, start in zip(rows, starts or [None] * len(rows))]
    cursor = (1, 0, q, 0) if state is None else tuple(state["next"])
    entries += [((e, p, g, r), None) for e in range(1, epochs + 1) for p in range(len(paths))
                for g in range(q, pq.ParquetFile(paths[p]).num_row_groups, world_size)
                for r in range(num_rows[p, g]) if (e, p, g, r) >= cursor]
    return entries


def tagged_tokens(entries, texts) -> list[tuple]:
    """((document key, position), token) for every token of the entries, in stream order."""
    return [((key, i), t) for key, start in entries
            for i, t in enumerate([BOS] + list(texts[key[1:]].encode())) if i >= (start or 0)]


@pytest.mark.parametrize("chain", [((2, 24), (3, None)), ((3, 100), (2, None)),
                                   ((1, 55), (3, None)), ((2, 24), (3, 4), (2, None)),
                                   ((3, 16), (2, 8), (3, None))])
def test_elastic_restart_of_the_concatenating_loader(chain, tmp_path):
    # ranks run k batches, their states are merged for the next world size, and so on (k None: run
    # past the plan). Every rank's stream must be exactly its entries (plan, then regular stream),
    # and every token of the interrupted epochs consumed (emitted as an input) exactly once across
    # all of them: a document a rank had started is dealt from its first token not yet consumed.
    # Short batches (B*T = 10), so that the rest of such a document is often still buffered at a
    # state
    elastic_corpus(tmp_path, seed=sum(k or 0 for _, k in chain))
    cfg = dict(B=2, T=5, tokenizer_batch_size=3, prefetch=0, data_dir=str(tmp_path))
    BT = cfg["B"] * cfg["T"]
    texts = texts_by_key(tmp_path)
    paths = split_parquet_files("train", str(tmp_path))
    consumed, merged, pieces_dealt, pieces_resumed = [], None, False, 0
    for step, (world_size, k) in enumerate(chain):
        states = []
        for q in range(world_size):
            mine = merged["states"][q] if merged else None
            tagged = tagged_tokens(concat_entries(mine, q, world_size, paths, texts, epochs=8),
                                   texts)
            plan_tokens = len(tagged_tokens(
                concat_entries(mine, q, world_size, paths, texts, epochs=0), texts))
            n = k if k is not None else plan_tokens // BT + 2
            run = take(open_loader("concat", cfg, rank=q, world_size=world_size,
                                   resume_state_dict=merged), n)
            assert stream_of(run) == [t for _, t in tagged[:n * BT + 1]], (
                f"rank {q} of {world_size}: another stream")
            consumed += [where for where, _ in tagged[:n * BT]]
            states.append(run[-1][2])
            # exact resume in the middle of a plan, first where the rest of a started document is
            # buffered
            mid_plan = [j for j, b in enumerate(run[:-1]) if b[2]["plan"] or b[2]["pieces"]]
            for j in sorted(mid_plan, key=lambda j: not run[j][2]["pieces"])[:4]:
                pieces_resumed += bool(run[j][2]["pieces"])
                resumed = open_loader("concat", cfg, rank=q, world_size=world_size,
                                      resume_state_dict=run[j][2])
                assert take(resumed, min(3, n - j - 1)) == run[j + 1:j + 4]
                resumed.close()
        if k is None:
            break
        merged = merge_states(states, chain[step + 1][0], data_dir=str(tmp_path))
        pieces_dealt |= any("pieces" in item for s in merged["states"] for item in s["plan"])
        last_epoch = merged["states"][0]["next"][0] - 1
    assert pieces_dealt and pieces_resumed, (
        "not vacuous: the rest of a started document was dealt, and resumed")
    counts = Counter(where for where in consumed if where[0][0] <= last_epoch)
    assert set(counts) == {((e, *key), i) for e in range(1, last_epoch + 1)
                           for key, text in texts.items() for i in range(len(text.encode()) + 1)}
    assert [where for where, c in counts.items() if c != 1] == []


# -----------------------------------------------------------------------------
# 8. every long-document policy resumes elastically


def placed_pieces(batch, trace, texts, overlap):
    """(document key, piece start, positions of the document newly placed) for every placement of a
    best-fit batch, checking that each row segment is the traced document or piece: BOS, then the
    document from its start (a piece: from start - overlap), the row's last one possibly cropped."""
    out = []
    for row, keys in zip(rows_of(batch), trace):
        # the last token is known from the targets only: -100 where it repeats an overlap token
        same = ((lambda got, want: got == want[:len(got)]
                 or (got[-1] == -100 and got[:-1] == want[:len(got) - 1]))
                if row[-1] == -100 else (lambda got, want: got == want[:len(got)]))
        heads = [i for i, t in enumerate(row) if t == BOS]
        assert heads[0] == 0 and len(heads) == len(keys)
        for n, (head, key) in enumerate(zip(heads, keys)):
            m = (heads[n + 1] if n + 1 < len(heads) else len(row)) - head
            doc = [BOS] + list(texts[key[1:4]].encode())
            start = getattr(key, "start", None)  # a PieceKey: a piece of a split document
            if not start:
                assert same(row[head:head + m], doc)
                positions = range(0, m)
            else:
                a = max(1, start - overlap)
                assert same(row[head:head + m], [BOS] + doc[a:])
                positions = range(start, max(start, a + m - 1))
            out.append((key[:4], start, positions))
    return out


@pytest.mark.parametrize("policy,overlap", [("split", 0), ("split", 4), ("split_reuse", 0),
                                            ("split_reuse", 3)])
@pytest.mark.parametrize("n_old,n_new,k", [(2, 3, 6), (3, 2, 9), (1, 2, 6)])
def test_elastic_restart_with_split_policies(policy, overlap, n_old, n_new, k, tmp_path):
    # every token of every document not yet trained on is placed exactly once after the merge: under
    # "split" every piece of the cutting grid is placed once; under "split_reuse" every token is
    elastic_corpus(tmp_path, seed=n_old * 10 + k)
    cfg = dict(B=2, T=20, tokenizer_batch_size=3, buffer_size=6, prefetch=0, data_dir=str(tmp_path),
               trace_documents=True, split_overlap=overlap)
    texts = texts_by_key(tmp_path)
    placed, states = [], []
    for r in range(n_old):
        loader = open_loader(policy, cfg, rank=r, world_size=n_old)
        for _ in range(k):
            batch = take(loader, 1)[0]
            placed += placed_pieces(batch, loader.documents, texts, overlap)
        states.append(batch[2])
        loader.close()
    assert any(s["pieces"] for s in states), (
        "not vacuous: the old ranks held pieces of split documents")
    last_epoch = max(s["next"][0] for s in states)
    merged = merge_states(states, n_new, data_dir=str(tmp_path))
    assert any("pieces" in item for s in merged["states"] for item in s["plan"])
    # (key, start) of old documents still buffered at the end (best-fit may keep one waiting)
    waiting = []
    for q in range(n_new):
        loader = open_loader(policy, cfg, rank=q, world_size=n_new, resume_state_dict=merged)
        for j in range(500):
            batch = take(loader, 1)[0]
            placed += placed_pieces(batch, loader.documents, texts, overlap)
            state = batch[2]
            if not state["plan"] and j >= 40:
                break
        assert not state["plan"], f"new rank {q} did not finish its plan"
        keys = decode_keys(state["buffer"])
        starts = dict(state["pieces"])
        waiting += [(key, starts.get(i)) for i, key in enumerate(keys) if key[0] <= last_epoch]
        loader.close()

    old_epochs = [(e, *key) for e in range(1, last_epoch + 1) for key in texts]

    def grid(key):
        """Where the document's pieces start (None: it is not split) and its length
        (oracle.split_document)."""
        doc = [BOS] + list(texts[key[1:]].encode())
        pieces = oracle.split_document(doc, key, cfg["T"] + 1, overlap)
        starts = [None] if len(pieces) == 1 else [next(t[2] for t in piece if t[3] == "doc")
                                                  for piece in pieces]
        return starts, len(doc)

    def waiting_span(key, start):
        starts, n = grid(key)
        return range(start or 0, min([c for c in starts[1:] if c > (start or 0)] + [n]))

    mine = [p for p in placed if p[0][0] <= last_epoch]
    positions = Counter([(key, i) for key, _, span in mine for i in span] +
                        [(key, i) for key, start in waiting for i in waiting_span(key, start)])
    assert max(positions.values()) == 1, "a token was trained on twice"
    if policy == "split_reuse":  # nothing is cropped: every token of every document, exactly once
        assert set(positions) == {(key, i) for key in old_epochs for i in range(grid(key)[1])}
    else:  # the grid's pieces, each placed (or still waiting) exactly once
        assert Counter([(key, start) for key, start, _ in mine] + waiting) == Counter(
            (key, start) for key in old_epochs for start in grid(key)[0])


# -----------------------------------------------------------------------------
# 9. every field of a state is checked: a state given new checksums after an edit (or one given with
#    allow_state_mismatch=True) resumes, or is refused with a ValueError that names the field; never
#    another error from deep inside, a hang, or a large allocation


def write_token_dir(directory, seed: int, n_docs: int = 40):
    """Two pretokenized shards of documents of 1 to 30 byte tokens after BOS."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for s in range(2):
        docs = [np.concatenate(([BOS], rng.integers(0, 256, size=rng.integers(0, 30))))
                .astype(np.uint16) for _ in range(n_docs)]
        write_token_shard(str(directory / f"shard_{s:03d}"), docs, [0] * n_docs, np.uint16)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Real states of real loaders, and how to resume from them:
    - resumes: kind -> (state, open(state, allow_state_mismatch) -> loader): best-fit under "crop"
      and "split_reuse" (buffered pieces), concatenating (an offset), rank 1's part of a merge for
      3 ranks (plans of rows, pieces and bitmaps), pretokenized, and a mixture's;
    - ranks: kind -> (the states of 2 ranks at one step, merge(states) -> the first new rank's
      loader)."""
    root = tmp_path_factory.mktemp("saved")
    cfg = write_small(root / "parquet")
    split = dict(cfg, split_overlap=2)
    for split_name, seed in (("train", 1), ("val", 2)):
        write_token_dir(root / "tokens" / split_name, seed)
        for bucket, bucket_seed in (("web", 3), ("code", 4)):
            write_token_dir(root / "mix" / split_name / bucket, seed * 10 + bucket_seed)
    tok = dict(device="cpu", buffer_size=4, chunk_size=8, batch_size=3, prefetch=0, bos_token=BOS)
    curriculum = [{"tokens": 600, "mix": {"web": 0.5, "code": 0.5}},
                  {"tokens": 600, "mix": {"code": 1.0}}]

    def pretokenized(state, allow=False, **over):
        return PRETOKENIZED(2, 16, "train", resume_state_dict=state, allow_state_mismatch=allow,
                            data_dir=str(root / "tokens"), **tok, **over)

    def mixture(state, allow=False, **over):
        return MIX(2, 16, "train", curriculum, resume_state_dict=state, allow_state_mismatch=allow,
                   data_dir=str(root / "mix"), **tok, **over)

    def state_of(open_loader, k, **over):
        loader = open_loader(None, **over)
        state = take(loader, k)[-1][2]
        loader.close()
        return state

    split_ranks = rank_states("split_reuse", split, 2, 5)
    shuffle = dict(shuffle=True, seed=3, shuffle_window=2)
    shuffled_ranks = rank_states("split_reuse", split, 2, 5, **shuffle)
    mixture_ranks = [state_of(mixture, 4, rank=r, world_size=2) for r in range(2)]
    merged = merge_states(split_ranks, 3, data_dir=cfg["data_dir"])
    resumes = {
        "bestfit": (state_after("bestfit", cfg, 6), lambda state, allow: open_loader(
            "bestfit", cfg, resume_state_dict=state, allow_state_mismatch=allow)),
        "split_reuse": (state_after("split_reuse", split, 6), lambda state, allow: open_loader(
            "split_reuse", split, resume_state_dict=state, allow_state_mismatch=allow)),
        "concat": ([s for _, _, s in take(open_loader("concat", cfg), 12) if s["offset"]][-1],
                   lambda state, allow: open_loader("concat", cfg, resume_state_dict=state,
                                                    allow_state_mismatch=allow)),
        "merged": (merged, lambda state, allow: open_loader(
            "split_reuse", split, resume_state_dict=state, allow_state_mismatch=allow, rank=1,
            world_size=3)),
        "pretokenized": (state_of(pretokenized, 6), pretokenized),
        "mixture": (state_of(mixture, 6), mixture),
        "shuffled": (state_of(pretokenized, 6, **shuffle),
                     lambda state, allow: pretokenized(state, allow, **shuffle)),
        "shuffled_merged": (
            merge_states(shuffled_ranks, 3, data_dir=cfg["data_dir"]),
            lambda state, allow: open_loader("split_reuse", split, resume_state_dict=state,
                                             allow_state_mismatch=allow, rank=1, world_size=3,
                                             **shuffle)),
    }
    ranks = {
        "split_reuse": (split_ranks, lambda states: open_loader(
            "split_reuse", split, rank=0, world_size=3,
            resume_state_dict=merge_states(states, 3, data_dir=cfg["data_dir"]))),
        "mixture": (mixture_ranks, lambda states: mixture(
            merge_states(states, 3, data_dir=str(root / "mix")), rank=0, world_size=3)),
        "shuffled": (shuffled_ranks, lambda states: open_loader(
            "split_reuse", split, rank=0, world_size=3, **shuffle,
            resume_state_dict=merge_states(states, 3, data_dir=cfg["data_dir"]))),
    }
    # not vacuous: the fields that need the most checking are there
    assert resumes["split_reuse"][0]["pieces"] and resumes["concat"][0]["offset"] > 0
    assert any("pieces" in item for item in merged["states"][1]["plan"])
    assert any("row_groups" in item for item in merged["states"][1]["plan"])
    assert any(len(s["next"]) == 3 and s["next"][2] > 0 for s in shuffled_ranks)
    assert any("row_groups" in item for item in resumes["shuffled_merged"][0]["states"][1]["plan"])
    assert all(b["buffer"] for s in mixture_ranks + [resumes["mixture"][0]]
               for b in s["buckets"].values())
    return {"resumes": resumes, "ranks": ranks}


def paths_of(value, path=()):
    """The path (keys and indices) of every part of a plain-data value, under `path`."""
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths_of(item, path + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from paths_of(item, path + (i,))


GARBAGE = [None, True, 1.5, "x", "", "0" * 32, "zz" * 16, -1, 0, 1, 7, 10**6, 10**18, -10**9, [],
           {}, [[]], [0, -10**6], [0, -10**9], [[0, 5]], {"a": [None, {"b": []}]}]


def mutate(state, data) -> tuple:
    """Change one part of state in place, as drawn: replaced by garbage, an int nudged, a key or an
    item deleted, or one added. Returns its path."""
    path = data.draw(st.sampled_from(list(paths_of(state))[1:]), label="path")
    parent = state
    for key in path[:-1]:
        parent = parent[key]
    key, value = path[-1], parent[path[-1]]
    how = data.draw(st.sampled_from(["replace", "nudge", "delete", "add"]), label="how")
    garbage = copy.deepcopy(data.draw(st.sampled_from(GARBAGE), label="garbage"))
    if how == "nudge" and isinstance(value, int) and not isinstance(value, bool):
        parent[key] = value + data.draw(st.sampled_from([-1, 1, 3, 10**6, -10**9]), label="by")
    elif how == "delete":
        del parent[key]
    elif how == "add" and isinstance(value, dict):
        value["junk"] = garbage
        path += ("junk",)
    elif how == "add" and isinstance(value, list):
        value.append(garbage)
    else:
        parent[key] = garbage
    return path


def recompute_checksums(state) -> None:
    """Make every checksum of an edited state match its contents again, as a hand edit can."""
    if not isinstance(state, dict):
        return
    if "merged" in state:
        for s in (state["states"] if isinstance(state.get("states"), list) else ()):
            recompute_checksums(s)
    elif state.get("loader") == "mixture":
        for bucket in (state["buckets"].values() if isinstance(state.get("buckets"), dict) else ()):
            recompute_checksums(bucket)
        add_mixture_checksum(state)
    else:
        add_checksum(state)


# fields an error may name instead of the edited one (a shorter buffer leaves its pieces or offset
# pointing past it; what a merge deals becomes a plan)
RELATED = {"buffer": ("pieces", "offset", "plan"), "pieces": ("plan",), "offset": ("plan",),
           "next": ("plan",)}


def names_it(message: str, path: tuple) -> bool:
    """Whether an error names the edited part: a key on its path, or a field related to one."""
    names = [key for key in path if isinstance(key, str)]
    names += [name for key in names for name in RELATED.get(key, ())]
    return any(name in message for name in names)


@contextlib.contextmanager
def bounded(seconds: float = 20, megabytes: float = 64):
    """Fail a body that runs longer (a hang) or allocates more at its peak (Python and numpy
    memory)."""
    def timeout(*_):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, timeout)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    tracemalloc.start()
    try:
        yield
    finally:  # (also when the body raised: it must not have allocated much first)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        assert peak < megabytes * 2**20, f"allocated {peak / 2**20:.0f} MB"


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_field_of_an_edited_state_is_checked(saved, data):
    kind = data.draw(st.sampled_from(sorted(saved["resumes"])), label="kind")
    state, open_resumed = copy.deepcopy(saved["resumes"][kind][0]), saved["resumes"][kind][1]
    path = mutate(state, data)
    if path[-1] != "checksum":
        recompute_checksums(state)
    allow = data.draw(st.booleans(), label="allow_state_mismatch")
    with bounded():
        try:
            loader = open_resumed(state, allow)
            for _ in range(2):
                next(loader)
            event("resumed")
        except ValueError as e:
            assert names_it(str(e), path), f"{e} (edited: {path})"
            event("refused")
        except MixtureStop:  # an edited mixture state can validly say that the curriculum is done
            event("resumed")


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_field_of_an_edited_state_to_merge_is_checked(saved, data):
    kind = data.draw(st.sampled_from(sorted(saved["ranks"])), label="kind")
    states, merge_and_open = copy.deepcopy(saved["ranks"][kind][0]), saved["ranks"][kind][1]
    i = data.draw(st.integers(0, len(states) - 1), label="rank")
    path = mutate(states[i], data)
    if path[-1] != "checksum":
        recompute_checksums(states[i])
    with bounded():
        try:
            next(merge_and_open(states))
            event("merged and resumed")
        except ValueError as e:
            assert names_it(str(e), path), f"{e} (edited: {path} of states[{i}])"
            event("refused")
        except MixtureStop:
            event("merged and resumed")


def set_path(path, value):
    """An edit: state[path[0]][path[1]]... = value."""
    def edit(state):
        for key in path[:-1]:
            state = state[key]
        state[path[-1]] = value
    return edit


def first_rows_item(state) -> dict:
    return next(item for item in state["states"][1]["plan"] if "rows" in item)


def first_bitmap_item(state) -> dict:
    return next(item for item in state["states"][1]["plan"] if "row_groups" in item)


@pytest.mark.parametrize("kind,edit,new_checksum,match", [
    # a counter that is not one (it must not become a packer attribute); a run of a billion rows
    ("bestfit", set_path(["counters", "fill"], None), True,
     r"\['counters'\] has an unknown counter 'fill'"),
    ("bestfit", set_path(["counters", "fill"], None), False,
     r"\['counters'\] has an unknown counter 'fill'"),
    ("bestfit", set_path(["buffer", 0, 3], [0, -10**9]), True,
     r"\['buffer'\] holds 100000000\d whole documents, more than the 21 a bestfit loader"),
    ("bestfit", set_path(["counters", "tokens_in"], None), True,
     r"\['counters'\]\['tokens_in'\] must be an integer >= 0, got None"),
    ("bestfit", set_path(["counters", "rows"], -5), True,
     r"\['counters'\]\['rows'\] must be an integer >= 0, got -5"),
    ("bestfit", set_path(["buffer", 0, 3], [0, -10]), True,
     r"\['buffer'\]\[0\] refers to document 10 of shard_00000.parquet row group 0, "
     r"which has 6 documents"),
    ("bestfit", set_path(["buffer", 0, 1], 9), True,
     r"\['buffer'\]\[0\] refers to file 9, row group 0"),
    ("bestfit", set_path(["buffer", 0, 3], [-1, 3]), True,
     r"\['buffer'\]\[0\] must be a non-empty list of indices"),
    ("bestfit", set_path(["buffer", 0], [1, 0, 0]), True,
     r"\['buffer'\]\[0\] must be \[epoch >= 1, pq_idx"),
    ("bestfit", set_path(["next"], [1, 0, 4]), True,
     r"\['next'\] must be \[epoch >= 1, pq_idx, rg_idx, doc_index\]"),
    ("bestfit", set_path(["next", 3], 10**6), True,
     r"\['next'\] = \[1, 0, 4, 1000000\] is not a place where rank 0"),
    ("bestfit", set_path(["next", 1], 3), True, r"\['next'\] = \[1, 3, 4, 0\] is not a place"),
    ("bestfit", set_path(["emitted", "hash"], "zz" * 16), True,
     r"\['emitted'\]\['hash'\] must be 32 lowercase hex digits"),
    ("bestfit", set_path(["emitted", "batches"], -1), True,
     r"\['emitted'\]\['batches'\] must be an integer >= 0"),
    ("bestfit", set_path(["emitted", "junk"], 1), True,
     r"\['emitted'\] has an unknown field 'junk'"),
    ("bestfit", set_path(["offset"], 1), True,
     r"\['offset'\] must be 0 for a best-fit state, got 1"),
    ("bestfit", set_path(["epoch"], 0), True, r"\['epoch'\] must be an integer >= 1, got 0"),
    ("bestfit", set_path(["pq_idx"], 10**9), True,
     r"\['pq_idx'\], \['rg_idx'\] = 1000000000, 3: a row group"),
    ("bestfit", set_path(["loader"], ["bestfit"]), True,
     r"\['loader'\] must be 'bestfit' or 'concat'"),
    ("bestfit", set_path(["loader"], "concat"), True,
     r"\['config'\]\['loader'\] is 'bestfit', but the state is"),
    ("bestfit", set_path(["junk"], 1), True, r"resume_state_dict has an unknown field 'junk'"),
    ("bestfit", set_path(["config", "rank"], 5), True,
     r"\['config'\]\['rank'\] is 5, but world_size is 1"),
    ("bestfit", set_path(["config", "T"], "16"), True,
     r"\['config'\]\['T'\] must be an integer >= 1, got '16'"),
    ("bestfit", set_path(["config", "junk"], None), True,
     r"\['config'\] has an unknown field 'junk'"),
    ("bestfit", set_path(["config", "split_overlap"], 3), True,
     r"\['config'\]\['split_overlap'\] must be an integer in"),
    ("bestfit", set_path(["checksum"], "x"), False,
     r"\['checksum'\] must be 32 lowercase hex digits"),
    ("bestfit", set_path(["counters", "rows"], b"12"), False,
     r"resume_state_dict is not plain data"),
    # pieces (split documents), and the concatenating loader's offset: checked against the
    # documents' lengths
    ("split_reuse", set_path(["pieces"], [[1, 0], [0, 0]]), True,
     r"\['pieces'\]: \[0, 0\] is not \[index, start\]"),
    ("split_reuse", set_path(["pieces"], [[10**6, 0]]), True,
     r"\['pieces'\]: \[1000000, 0\] is not \[index, start\]"),
    ("split_reuse", set_path(["pieces", 0, 1], 10**6), True,
     r"\['pieces'\] starts buffered entry \d+ at token 1000000"),
    ("concat", set_path(["offset"], 10**6), True,
     r"\['offset'\] is 1000000, but the first buffered entry has \d+"),
    ("concat", set_path(["buffer"], []), True, r"\['offset'\] must be 0 when the buffer is empty"),
    ("concat", set_path(["counters", "docs_split"], 0), True,
     r"\['counters'\] has an unknown counter 'docs_split'"),
    # a merge: its envelope, and rank 1's plan (rows, pieces, bitmaps)
    ("merged", set_path(["merged"], 3), True,
     r"resume_state_dict\['merged'\] must be a dict, got int"),
    ("merged", set_path(["states", 1], "x"), True,
     r"resume_state_dict\['states'\]\[1\] must be a dict, got str"),
    ("merged", lambda s: first_bitmap_item(s).update(row_groups="!!!!"), True,
     r"\['states'\]\[1\]\['plan'\]\[\d+\]\['row_groups'\] must be the base64 bitmap of "
     r"21 row groups"),
    ("merged", lambda s: first_bitmap_item(s).update(row_groups="AA==", total=8), True,
     r"\['states'\]\[1\]\['plan'\]\[\d+\]\['total'\] is 8, but the data has 21 row groups"),
    ("merged", lambda s: first_rows_item(s).update(rows=[0, -10**6]), True,
     r"\['states'\]\[1\]\['plan'\]\[\d+\]\['rows'\] refers to document 1000000 of "
     r"shard_0000\d.parquet"),
    ("merged", lambda s: first_rows_item(s).update(rows=[0, 1, 0, 1, 0, 1, 0, 1, 0]), True,
     r"\['states'\]\[1\]\['plan'\]\[\d+\]\['rows'\] lists 9 whole documents of a row group "
     r"that has [5-7]"),
    ("merged", lambda s: first_rows_item(s).update(rows=[0], pieces=[[0, 10**6]]), True,
     r"\['states'\]\[1\]\['plan'\] deals document \(1, \d, \d, 0\) from token 1000000, "
     r"but it has \d+"),
    # the pretokenized loader's chunks, and a mixture's own fields and its buckets' states
    ("pretokenized", set_path(["buffer", 0, 3], [9]), True,
     r"\['buffer'\]\[0\] refers to document 9 of shard_00\d.bin chunk \d+, which has 8 documents"),
    ("mixture", set_path(["dropped"], ["nope"]), True,
     r"\['dropped'\] must list buckets of the mixture"),
    ("mixture", lambda s: s["buckets"].pop("code"), True, r"\['buckets'\] is missing 'code'"),
    ("mixture", set_path(["phase"], 0), True, r"\['phase'\] must be an integer >= 1, got 0"),
    ("mixture", set_path(["phase"], 3), True, r"\['phase'\] is 3, but the curriculum has 2 phases"),
    ("mixture", set_path(["phase_tokens_done"], 10**9), True,
     r"\['phase_tokens_done'\] is 1000000000, more than"),
    ("mixture", set_path(["buckets", "web", "counters", "fill"], None), True,
     r"resume_state_dict\['buckets'\]\['web'\]\['counters'\] has an unknown counter 'fill'"),
    ("mixture", set_path(["buckets", "code", "next", 3], 10**6), True,
     r"resume_state_dict\['buckets'\]\['code'\]\['next'\] = .* is not a place"),
])
def test_edited_fields_are_refused_by_name(saved, kind, edit, new_checksum, match):
    state, open_resumed = copy.deepcopy(saved["resumes"][kind][0]), saved["resumes"][kind][1]
    edit(state)
    if new_checksum:
        recompute_checksums(state)
    with bounded(), pytest.raises(ValueError, match=match):
        # no new checksum: given with allow_state_mismatch=True
        loader = open_resumed(state, not new_checksum)
        for _ in range(2):
            next(loader)


@pytest.mark.parametrize("kind,i,edit,match", [
    ("split_reuse", 1, set_path(["next", 0], 10**9),
     r"states\[1\]\['next'\] is in epoch 1000000000, 999999999 past another rank's, "
     r"more than the \d+ tokens"),
    ("split_reuse", 0, set_path(["buffer", 0, 3], [0, -10**9]),
     r"states\[0\]\['buffer'\] holds 100000000\d whole"),
    ("split_reuse", 1, set_path(["counters", "fill"], None),
     r"states\[1\]\['counters'\] has an unknown counter"),
    ("split_reuse", 1, set_path(["offset"], 2),
     r"states\[1\]\['offset'\] must be 0 for a best-fit state"),
    ("mixture", 1, set_path(["buckets", "code", "buffer", 0, 3], [0, -10**9]),
     r"states\[1\]\['buckets'\]\['code'\]\['buffer'\] holds 100000000\d whole"),
    ("mixture", 1, set_path(["buckets", "web", "next", 0], 10**9),
     r"states\[1\]\['buckets'\]\['web'\]\['next'\] is in epoch 1000000000"),
    ("mixture", 0, set_path(["generation"], -1),
     r"states\[0\]\['generation'\] must be an integer >= 0, got -1"),
])
def test_edited_states_to_merge_are_refused_by_name(saved, kind, i, edit, match):
    states, merge_and_open = copy.deepcopy(saved["ranks"][kind][0]), saved["ranks"][kind][1]
    edit(states[i])
    recompute_checksums(states[i])
    with bounded(seconds=10), pytest.raises(ValueError, match=match):
        merge_and_open(states)

"""
Record what the public loaders yield on fixed inputs, and compare two recordings: the proof that a
change (merging a branch, moving code between modules) left their observable behaviour as it was.

    python -m scripts.record_behaviour record /tmp/before.json [--work DIR]    # ~5 s on 2 cores
    python -m scripts.record_behaviour compare /tmp/before.json /tmp/after.json
    python -m scripts.record_behaviour check /tmp/before.json     # record anew, then compare

The inputs (build_inputs) are parquet shards, a BPE trained on them, their pretokenized shards and
mixture buckets, all from a seeded random.Random. The configurations (77 of them, 1,324 steps) run
every public loader on CPU in this process: best-fit, concatenating, pretokenized and mixture,
ranks and world sizes, each long-document policy, shuffled, val, stateless, resumed from a state
and merged 3 -> 2 ranks. Each batch is recorded as take() says. Not covered: CUDA, torchrun, the
mixture's stop agreement, downloads, bad input. compare prints, per configuration, "identical" or
the first step and field that differ, and exits 1 on any difference, 2 on a bad recording.
"""

import argparse
import contextlib
import hashlib
import io
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from importlib import metadata

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from nanochat.data.base.cli import run
from nanochat.dataloader import (pretokenized_distributed_data_loader_bos_bestfit,
                                 pretokenized_distributed_data_loader_with_state_bos_bestfit,
                                 tokenizing_distributed_data_loader,
                                 tokenizing_distributed_data_loader_bos_bestfit,
                                 tokenizing_distributed_data_loader_with_state,
                                 tokenizing_distributed_data_loader_with_state_bos_bestfit)
from nanochat.mixture import (MixtureStop, pretokenized_mixture_loader_bos_bestfit,
                              pretokenized_mixture_loader_with_state_bos_bestfit)
from nanochat.pretokenize import main as pretokenize_main
from nanochat.data.processing.tokenize_pair import pretokenize_file
from nanochat.resume import merge_states
from nanochat.tokenizer import TOKENIZER_FILENAME, RustBPETokenizer

FORMAT = "nanochat-behaviour-recording"
VERSION = 1
SEED = 1234
VOCAB_SIZE = 512
TEXT_LIMIT = 1000  # canonical JSON longer than this is recorded as its sha256 and length
# their versions are recorded: a new one may change the input files, and compare says so
LIBRARIES = ("numpy", "torch", "pyarrow", "tiktoken", "rustbpe")

# -----------------------------------------------------------------------------
# Inputs

# accents, CJK, Arabic, Cyrillic, emoji and a combining mark: every byte length of UTF-8
WORDS = ("the data loader packs rows of tokens into batches while long documents are cut and short "
         "ones wait naïve café straße déjà Ωmega 東京 日本語 مرحبا привет 🙂 🚀 e\u0301").split()
SYLLABLES = ["ka", "lo", "mi", "ren", "tus", "vo", "shi", "qu", "ex", "ba", "nd", "or", "é", "ü"]
PUNCTUATION = [",", ".", "\n", "!", "(x)", "—", "\t", "?"]
# (documents, row group size); the last is val. Uneven row groups: reads cross their edges
PARQUET_SHARDS = [(70, 8), (45, 5), (90, 11), (30, 7)]
BUCKETS = {  # name: (documents per shard, share of long documents, longest document in words)
    "code": (60, 0.0, 15), "math": (40, 0.1, 120), "web": (40, 0.3, 300), "tiny": (2, 1.0, 200)}
# the mixture's and the pretokenized loader's chunk_size (entries dealt to ranks at a time)
BUCKET_CHUNK = 8


def make_text(rng: random.Random, n_words: int) -> str:
    parts = []
    for _ in range(n_words):
        r = rng.random()
        if r < 0.55:
            parts.append(rng.choice(WORDS))
        elif r < 0.8:  # made-up words: the BPE must split what it never merged
            parts.append("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))))
        elif r < 0.92:  # numbers of 1 to 6 digits: the split pattern cuts them in runs of 2
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 6))))
        else:
            parts.append(rng.choice(PUNCTUATION))
    return " ".join(parts)


def make_texts(rng: random.Random, n: int, long_share: float = 0.15,
               longest: int = 400) -> list[str]:
    """n documents: one in twenty empty, long_share of them 150..longest words (many rows at
    T=32), the rest 1-40 words."""
    texts = []
    for _ in range(n):
        r = rng.random()
        if r < 0.05:
            n_words = 0
        elif r < 0.05 + long_share:
            n_words = rng.randint(min(150, longest), longest)
        else:
            n_words = rng.randint(1, 40)
        texts.append(make_text(rng, n_words))
    return texts


def write_parquet(path: str, texts: list[str], row_group_size: int) -> None:
    """One shard like the real ones: a single `text` column, zstd, fixed-size row groups."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    table = pa.table({"text": pa.array(texts, type=pa.string())})
    pq.write_table(table, path, row_group_size=row_group_size, compression="zstd")


def train_tokenizer(texts: list[str], tokenizer_dir: str, check_dir: str) -> RustBPETokenizer:
    """Train and save the BPE, then train it again: the two tokenizer.json must be the same bytes
    (rustbpe breaks ties deterministically; if it did not, recordings would differ run to run)."""
    saved = []
    for directory in (tokenizer_dir, check_dir):
        tokenizer = RustBPETokenizer.train_from_iterator(iter(texts), VOCAB_SIZE)
        tokenizer.save(directory)
        with open(os.path.join(directory, TOKENIZER_FILENAME), "rb") as f:
            saved.append(f.read())
    shutil.rmtree(check_dir)  # not an input: kept out of the recorded file digests
    if saved[0] != saved[1]:
        raise RuntimeError("training the tokenizer twice on the same texts gave two different "
                           "tokenizer.json: recordings would differ run to run; record with a "
                           "fixed tokenizer instead")
    return tokenizer


def run_pretokenize(argv: list[str]) -> None:
    """`python -m nanochat.pretokenize ARGV` in this process, its output kept unless it fails."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        code = pretokenize_main(argv)
    if code != 0:
        raise RuntimeError(f"python -m nanochat.pretokenize {' '.join(argv)} failed:\n"
                           f"{output.getvalue()}")


def build_inputs(work: str) -> dict:
    """Write every input under work; returns their paths and the tokenizer: 4 parquet shards (3
    train, 1 val; uneven row groups; empty documents and documents many rows long); a 512-token BPE
    trained on the train shards, twice (train_tokenizer); the shards pretokenized by
    `python -m nanochat.pretokenize`'s main(), whole and with --max-length 33 --overlap-size 4;
    mixture buckets train/{code,math,tiny,web} and val/{code,math,web} written by pretokenize_file
    (web windowed). The sha256 of every input file is recorded too: the pretokenized ones are
    pretokenize's own behaviour."""
    rng = random.Random(SEED)  # one stream for every input, drawn in a fixed order
    parquet = os.path.join(work, "parquet")
    train_texts = []
    for i, (n, row_group_size) in enumerate(PARQUET_SHARDS):
        texts = make_texts(rng, n)
        write_parquet(os.path.join(parquet, f"shard_{i:05d}.parquet"), texts, row_group_size)
        if i < len(PARQUET_SHARDS) - 1:  # the tokenizer never sees val, as in nanochat
            train_texts += texts
    tokenizer_dir = os.path.join(work, "tokenizer")
    tokenizer = train_tokenizer(train_texts, tokenizer_dir, os.path.join(work, "tokenizer_again"))
    # one worker: the same bytes either way, and no process pool to start
    common = ["--input", parquet, "--tokenizer-dir", tokenizer_dir, "--num-workers", "1"]
    whole, windowed = os.path.join(work, "tokens_whole"), os.path.join(work, "tokens_windowed")
    run_pretokenize(common + ["--output", whole])
    run_pretokenize(common + ["--output", windowed, "--max-length", "33", "--overlap-size", "4"])
    # mixture buckets: <mixture>/<split>/<bucket>/shard_*.bin|.idx, two train shards and one val
    # shard each
    mixture = os.path.join(work, "mixture")
    for name, (n, long_share, longest) in BUCKETS.items():
        windows = {"max_length": 33, "overlap": 4} if name == "web" else {}
        shards = [("train", 0), ("train", 1)] + ([("val", 2)] if name != "tiny" else [])
        for split, i in shards:
            path = os.path.join(work, "mixture_text", name, f"shard_{i:05d}.parquet")
            write_parquet(path, make_texts(rng, n, long_share, longest), row_group_size=16)
            pretokenize_file(tokenizer, path, os.path.join(mixture, split, name, f"shard_{i:05d}"),
                             num_threads=1, **windows)
    return {"parquet": parquet, "tokenizer": tokenizer, "whole": whole, "windowed": windowed,
            "mixture": mixture}


def file_digests(work: str) -> dict[str, str]:
    """sha256 of every file under work, by its path relative to work."""
    digests = {}
    for root, dirs, files in os.walk(work):
        dirs.sort()  # os.walk visits in the order of this list: sorted, the same on every disk
        for name in sorted(files):
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                relative = os.path.relpath(path, work).replace(os.sep, "/")
                digests[relative] = hashlib.sha256(f.read()).hexdigest()
    return digests


# -----------------------------------------------------------------------------
# Recording steps


def digest_tensor(t: torch.Tensor) -> dict:
    """dtype, shape and the sha256 of dtype, shape and bytes of a CPU tensor."""
    # dtype and shape in the hash too: the same bytes as int32 or as (4, 2) are another batch
    h = hashlib.sha256(f"{t.dtype} {list(t.shape)}\n".encode())
    h.update(t.contiguous().numpy().tobytes())
    return {"dtype": str(t.dtype), "shape": list(t.shape), "sha256": h.hexdigest()}


def digest_json(value) -> dict:
    """Canonical JSON of value: the text when short, else its sha256 and length."""
    text = json.dumps(value, sort_keys=True)  # sorted keys: one text for one value
    if len(text) <= TEXT_LIMIT:  # kept as text, so compare can name the key that differs
        return {"json": text}
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "length": len(text)}


def take(loader, steps: int, *, with_state: bool = True,
         attention: bool = False) -> tuple[list[dict], dict]:
    """Record up to `steps` batches of a loader (fewer when a mixture stops; its stop is the last
    record), then close it. Returns the records and the last state yielded. A batch's record:
    inputs and targets (digest_tensor); the state (digest_json); loader.stats without wait_seconds
    (a time); with trace_documents the documents of each row; with attention_info the digests of
    doc_ids, position_ids and cu_seqlens. A mixture's stop (CurriculumComplete, BucketExhausted):
    the exception's class, message and state."""
    records, state = [], None
    try:
        for _ in range(steps):
            try:
                batch = next(loader)
            except MixtureStop as stop:
                records.append({"stop": type(stop).__name__, "message": str(stop),
                                "state": digest_json(stop.state)})
                break
            record = {"inputs": digest_tensor(batch[0]), "targets": digest_tensor(batch[1])}
            if with_state:
                state = batch[2]
                record["state"] = digest_json(state)
            if attention:  # the attention outputs come last in the batch
                record["attention"] = {key: digest_tensor(value)
                                       for key, value in sorted(batch[-1].items())}
            if loader.documents is not None:
                record["documents"] = digest_json(loader.documents)
            # wait_seconds is a time: it would differ on every run
            stats = {k: v for k, v in loader.stats.items() if k != "wait_seconds"}
            record["stats"] = digest_json(stats)
            records.append(record)
    finally:
        loader.close()  # its background threads end before the next configuration starts
    return records, state


def checkpointed(state: dict) -> dict:
    """The state as a training script gets it back from a checkpoint's JSON."""
    return json.loads(json.dumps(state))  # tuples become lists, int keys become strings


def label(kind: str, split: str, kw: dict) -> str:
    """A configuration's name: the loader, the split and the arguments that vary (the data by its
    directory)."""
    shown = [f"data={os.path.basename(kw['data_dir'])}"]  # the temporary path differs every run
    shown += [f"{k}={v}" for k, v in kw.items()
              if k not in ("device", "data_dir", "tokenizer_threads")]
    return f"{kind} {split} {' '.join(shown)}"


def run_all(kind: str, make, split: str, kw: dict, steps: int, *, attention: bool = False,
            with_state: bool = True):
    """(name, records) of a fresh loader."""
    records, _ = take(make(split=split, **kw), steps, with_state=with_state, attention=attention)
    yield label(kind, split, kw), records


def run_resumed(kind: str, make, split: str, kw: dict, k: int, steps: int):
    """(name, records) of a loader resumed from the state after k steps: its next `steps`
    batches."""
    _, state = take(make(split=split, **kw), k)
    resumed = make(split=split, resume_state_dict=checkpointed(state), **kw)
    yield f"{label(kind, split, kw)} resumed after {k}", take(resumed, steps)[0]


def run_elastic(kind: str, make, split: str, kw: dict, k: int, steps: int, *, data_dir: str):
    """(name, records): the states of 3 ranks after k steps merged into 2 (one record per new
    rank), then each new rank's `steps` batches resumed from the merge."""
    states = [take(make(split=split, rank=r, world_size=3, **kw), k)[1] for r in range(3)]
    merged = checkpointed(merge_states([checkpointed(s) for s in states], 2, data_dir=data_dir))
    name = f"{label(kind, split, kw)} elastic 3->2 after {k}"
    yield f"{name} merged", [{"state": digest_json(s)} for s in merged["states"]]
    for q in range(2):
        loader = make(split=split, rank=q, world_size=2, resume_state_dict=merged, **kw)
        yield f"{name} rank {q}/2", take(loader, steps)[0]


# -----------------------------------------------------------------------------
# Configurations


def tokenizing_configurations(inputs: dict):
    tokenizer = inputs["tokenizer"]

    def bestfit(**kw):
        return tokenizing_distributed_data_loader_with_state_bos_bestfit(tokenizer, **kw)

    def bestfit_stateless(**kw):
        return tokenizing_distributed_data_loader_bos_bestfit(tokenizer, **kw)

    def concat(**kw):
        return tokenizing_distributed_data_loader_with_state(tokenizer, **kw)

    def concat_stateless(**kw):
        return tokenizing_distributed_data_loader(tokenizer, **kw)

    parquet = inputs["parquet"]
    # one tokenizer thread: the same batches either way, and no thread start-up to wait for
    common = dict(device="cpu", data_dir=parquet, tokenizer_threads=1)
    small = dict(common, B=2, T=32, buffer_size=8, tokenizer_batch_size=4)
    one = dict(rank=0, world_size=1)
    traced = dict(small, trace_documents=True, attention_info=True)
    split = dict(long_doc_policy="split", split_overlap=3)
    # best-fit: shapes and buffers, background threads off, every rank of 3 (the second epoch from
    # step ~18), several epochs (rank 2 of 3 reads ~1/3 of 19,602 tokens: ~2.5 steps of 8 x 128 an
    # epoch)
    yield from run_all("bestfit", bestfit, "train", dict(traced, **one), 16, attention=True)
    yield from run_all("bestfit", bestfit, "train", dict(traced, **one, prefetch=0), 16,
                       attention=True)
    for B, T, buffer_size, tbs in [(4, 64, 32, 16), (1, 16, 1, 1)]:
        kw = dict(common, B=B, T=T, buffer_size=buffer_size, tokenizer_batch_size=tbs, **one)
        yield from run_all("bestfit", bestfit, "train", kw, 16)
    for rank in range(3):
        yield from run_all("bestfit", bestfit, "train", dict(small, rank=rank, world_size=3), 24)
    kw = dict(common, B=8, T=128, buffer_size=16, tokenizer_batch_size=8, rank=2, world_size=3)
    yield from run_all("bestfit", bestfit, "train", kw, 12)
    # long documents split into pieces (with overlap), also on every rank of 3
    for policy, overlap in [("split", 4), ("split_reuse", 2)]:
        kw = dict(traced, **one, long_doc_policy=policy, split_overlap=overlap)
        yield from run_all("bestfit", bestfit, "train", kw, 16, attention=True)
    for rank in range(3):
        yield from run_all("bestfit", bestfit, "train",
                           dict(traced, **split, rank=rank, world_size=3), 24, attention=True)
    yield from run_all("bestfit", bestfit, "val", dict(small, **one), 8)
    yield from run_all("bestfit", bestfit, "val", dict(small, **one, **split), 8)
    yield from run_all("bestfit_stateless", bestfit_stateless, "train", dict(small, **one), 6,
                       with_state=False)
    # resume: exactly from a state; approximately from nanochat's keys alone; elastic 3 -> 2
    yield from run_resumed("bestfit", bestfit, "train", dict(small, **one), 5, 16)
    yield from run_resumed("bestfit", bestfit, "train", dict(small, **split, rank=2, world_size=3),
                           5, 16)
    kw = dict(small, **one)
    state = take(bestfit(split="train", **kw), 5)[1]
    nanochat_state = {key: state[key] for key in ("pq_idx", "rg_idx", "epoch")}
    # the configuration's name as the recordings made so far spell it: a new one would differ
    yield (f"{label('bestfit', 'train', kw)} resumed from nanochat's keys after 5",
           take(bestfit(split="train", resume_state_dict=nanochat_state, **kw), 8)[0])
    yield from run_elastic("bestfit", bestfit, "train", dict(small, trace_documents=True), 5, 16,
                           data_dir=parquet)
    yield from run_elastic("bestfit", bestfit, "train", dict(small, **split), 5, 16,
                           data_dir=parquet)
    # shuffled: the order, a resume mid-window, an elastic merge
    shuffled = dict(shuffle=True, seed=1, shuffle_window=3)
    yield from run_all("bestfit", bestfit, "train", dict(traced, **one, **shuffled), 16,
                       attention=True)
    yield from run_all("bestfit", bestfit, "train", dict(small, **shuffled, rank=1, world_size=3),
                       24)
    yield from run_resumed("bestfit", bestfit, "train",
                           dict(small, **split, **shuffled, rank=2, world_size=3), 5, 16)
    yield from run_elastic("bestfit", bestfit, "train",
                           dict(small, **shuffled, trace_documents=True), 5, 16, data_dir=parquet)
    # the concatenating loader
    concat_kw = dict(common, B=2, T=32, tokenizer_batch_size=4)
    yield from run_all("concat", concat, "train", dict(concat_kw, **one), 16)
    for rank in range(3):
        yield from run_all("concat", concat, "train", dict(concat_kw, rank=rank, world_size=3), 16)
    yield from run_all("concat", concat, "val", dict(concat_kw, **one), 8)
    yield from run_all("concat_stateless", concat_stateless, "train", dict(concat_kw, **one), 6,
                       with_state=False)
    yield from run_resumed("concat", concat, "train", dict(concat_kw, **one), 5, 16)
    yield from run_elastic("concat", concat, "train", concat_kw, 5, 16, data_dir=parquet)
    yield from run_resumed("concat", concat, "train", dict(concat_kw, **one, **shuffled), 5, 16)


def pretokenized_configurations(inputs: dict):
    make = pretokenized_distributed_data_loader_with_state_bos_bestfit
    whole = dict(device="cpu", data_dir=inputs["whole"], B=2, T=32, buffer_size=8,
                 chunk_size=BUCKET_CHUNK, batch_size=4)
    windowed = dict(whole, data_dir=inputs["windowed"])
    one = dict(rank=0, world_size=1)
    traced = dict(trace_documents=True, attention_info=True)
    split = dict(long_doc_policy="split", split_overlap=4)
    yield from run_all("pretokenized", make, "train", dict(whole, **traced, **one), 16,
                       attention=True)
    yield from run_all("pretokenized", make, "train", dict(windowed, **traced, **one), 16,
                       attention=True)
    for rank in range(3):
        kw = dict(windowed, **traced, **split, rank=rank, world_size=3)
        yield from run_all("pretokenized", make, "train", kw, 24, attention=True)
    yield from run_all("pretokenized", make, "val", dict(whole, **one), 8)
    yield from run_all("pretokenized_stateless", pretokenized_distributed_data_loader_bos_bestfit,
                       "train", dict(whole, **one), 6, with_state=False)
    yield from run_resumed("pretokenized", make, "train", dict(windowed, **split, **one), 5, 16)
    yield from run_elastic("pretokenized", make, "train", dict(whole, trace_documents=True), 5, 16,
                           data_dir=inputs["whole"])
    shuffled = dict(shuffle=True, seed=2, shuffle_window=2)
    yield from run_all("pretokenized", make, "train", dict(windowed, **traced, **one, **shuffled),
                       16, attention=True)
    yield from run_resumed("pretokenized", make, "train",
                           dict(windowed, **split, **one, **shuffled), 5, 16)
    yield from run_elastic("pretokenized", make, "train",
                           dict(whole, trace_documents=True, **shuffled), 5, 16,
                           data_dir=inputs["whole"])


CURRICULA = {
    # 30 + 20 steps at B=2, T=32 on one rank (64 tokens a step), 10 + 7 on three
    "two_phases": [{"tokens": 1920, "mix": {"web": 0.5, "code": 0.3, "math": 0.2}},
                   {"tokens": 1280, "mix": {"web": 0.2, "code": 0.5, "math": 0.3}}],
    "val": [{"tokens": 640, "mix": {"web": 0.5, "code": 0.5}}],
    # "tiny" holds 4 documents of 239-315 tokens: validate finds 1,097 tokens for the 330
    # demanded, but each of its rows crops a whole document, so it runs dry within a few steps:
    # BucketExhausted
    "tiny": [{"tokens": 640, "mix": {"web": 0.5, "tiny": 0.5}}],
    # predicted to run dry (validate's warning): with allow_bucket_exhaustion, dropped when it does
    "greedy": [{"tokens": 6400, "mix": {"web": 0.5, "tiny": 0.5}}],
}


def mixture_configurations(inputs: dict):
    # the buckets, written by pretokenize_file, have no pretokenize.json: their BOS is passed
    # (outside the labels, so that the configurations keep their names)
    bos = inputs["tokenizer"].get_bos_token_id()

    def mixture(curriculum: str, **kw):  # the curriculum by its name in CURRICULA (a short label)
        return pretokenized_mixture_loader_with_state_bos_bestfit(
            curriculum=CURRICULA[curriculum], bos_token=bos, **kw)

    def mixture_stateless(curriculum: str, **kw):
        return pretokenized_mixture_loader_bos_bestfit(curriculum=CURRICULA[curriculum],
                                                       bos_token=bos, **kw)

    kw = dict(device="cpu", data_dir=inputs["mixture"], B=2, T=32, buffer_size=8,
              chunk_size=BUCKET_CHUNK, batch_size=4, curriculum="two_phases")
    one = dict(rank=0, world_size=1)
    # each run goes on to CurriculumComplete (or the bucket's stop): at most 60 steps
    yield from run_all("mixture", mixture, "train", dict(kw, **one, trace_documents=True), 60)
    for rank in range(3):
        yield from run_all("mixture", mixture, "train", dict(kw, rank=rank, world_size=3), 60)
    yield from run_all("mixture", mixture, "train", dict(kw, **one, seed=1), 60)
    yield from run_all("mixture", mixture, "train",
                       dict(kw, **one, long_doc_policy="split_reuse", split_overlap=2), 60)
    yield from run_all("mixture", mixture, "val", dict(kw, **one, curriculum="val"), 60)
    yield from run_all("mixture_stateless", mixture_stateless, "train", dict(kw, **one), 6,
                       with_state=False)
    yield from run_all("mixture", mixture, "train", dict(kw, **one, curriculum="tiny"), 60)
    yield from run_all("mixture", mixture, "train",
                       dict(kw, **one, curriculum="greedy", allow_bucket_exhaustion=True), 60)
    for k in (10, 29):  # mid-phase; one step before phase 2, so the resumed loader crosses into it
        yield from run_resumed("mixture", mixture, "train", dict(kw, **one), k, 60)
    yield from run_elastic("mixture", mixture, "train", kw, 5, 60, data_dir=inputs["mixture"])
    yield from run_resumed("mixture", mixture, "train",
                           dict(kw, **one, shuffle=True, shuffle_window=2), 10, 60)
    yield from run_elastic("mixture", mixture, "train", dict(kw, shuffle=True), 5, 60,
                           data_dir=inputs["mixture"])


def record(work: str) -> dict:
    """Build the inputs under work and record every configuration."""
    inputs = build_inputs(work)
    configurations = {}
    for family in (tokenizing_configurations, pretokenized_configurations,
                   mixture_configurations):
        for name, records in family(inputs):
            # a repeated name would hide one configuration behind another
            assert name not in configurations, f"two configurations named {name!r}"
            configurations[name] = records
    environment = {"python": platform.python_version()}
    for library in LIBRARIES:
        environment[library] = metadata.version(library)
    return {"format": FORMAT, "version": VERSION, "environment": environment,
            "files": file_digests(work), "configurations": configurations}


# -----------------------------------------------------------------------------
# Comparing


def load_recording(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"recording {path} does not exist; make one: "
                                f"python -m scripts.record_behaviour record {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as e:  # bad JSON or bad UTF-8
        raise ValueError(f"{path} is not a recording: not JSON ({e}); record it again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a recording of python -m scripts.record_behaviour (no "
                         f"'format': {FORMAT!r})")
    if data.get("version") != VERSION:
        raise ValueError(f"{path} has recording version {data.get('version')!r}; this script reads "
                         f"{VERSION}: record the old side again with this script")
    # checked up front: a damaged file is named here, not met as a KeyError mid-compare
    for section in ("environment", "files", "configurations"):
        if not isinstance(data.get(section), dict):
            raise ValueError(f"{path} is damaged: its {section!r} is missing or not a mapping; "
                             "record it again")
    for name, steps in data["configurations"].items():
        if not isinstance(steps, list) or not all(isinstance(step, dict) for step in steps):
            raise ValueError(f"{path} is damaged: configuration {name!r} is not a list of steps; "
                             "record it again")
    return data


def short(value, limit: int = 160) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "..."  # one line of output per difference


def first_difference(a, b, path: str = "") -> str:
    """Where two JSON values first differ, e.g. "['next'][2]: old 5, new 6"."""
    if isinstance(a, dict) and isinstance(b, dict):
        # a state's checksum differs whenever anything else in it does: name that first
        for key in sorted(a.keys() | b.keys(), key=lambda k: (k == "checksum", k)):
            if key not in a or key not in b:
                return f"{path}[{key!r}]: only in {'old' if key in a else 'new'}"
            if a[key] != b[key]:
                return first_difference(a[key], b[key], f"{path}[{key!r}]")
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, f"{path}[{i}]")
        return f"{path}: old has {len(a)} items, new {len(b)}"  # one is a prefix of the other
    return f"{path}: old {short(a)}, new {short(b)}"


def unpack(x, y) -> tuple:
    """Two values of a field, with JSON kept as text on both sides parsed, so it is compared key by
    key."""
    if all(isinstance(v, dict) and set(v) == {"json"} and isinstance(v["json"], str)
           for v in (x, y)):
        try:
            return json.loads(x["json"]), json.loads(y["json"])
        except ValueError:  # text edited by hand into something else: show it as it is
            pass
    return x, y


def step_difference(old: list[dict], new: list[dict]) -> str | None:
    """Where two configurations' records first differ ("step 3, field 'state'['next'][2]: old 5,
    new 6"), or None."""
    for step, (a, b) in enumerate(zip(old, new), 1):
        for field in list(a) + [f for f in b if f not in a]:  # old's order, then new's extras
            if field not in a or field not in b:
                return f"step {step}, field {field!r}: only in {'old' if field in a else 'new'}"
            if a[field] != b[field]:
                where = first_difference(*unpack(a[field], b[field]))
                return f"step {step}, field {field!r}{where}"
    if len(old) != len(new):
        return f"step {min(len(old), len(new)) + 1}: old has {len(old)} steps, new {len(new)}"
    return None


def compare(old: dict, new: dict, old_path: str, new_path: str) -> bool:
    """Print the verdict on the files and on every configuration; True when all are identical."""
    print(f"old: {old_path}\nnew: {new_path}")
    for library in sorted(old["environment"].keys() | new["environment"].keys()):
        a, b = old["environment"].get(library), new["environment"].get(library)
        if a != b:  # a note, not a failure: the recordings themselves decide
            print(f"note: {library} {a} in old, {b} in new (input files may differ because of it)")
    old_files, new_files = old["files"], new["files"]
    changed = [p for p in old_files if p in new_files and old_files[p] != new_files[p]]
    changed += [f"{p} (only in old)" for p in old_files if p not in new_files]
    changed += [f"{p} (only in new)" for p in new_files if p not in old_files]
    print(f"files: DIFFERENT: {', '.join(changed)}" if changed
          else f"files: identical ({len(old_files)} files)")
    old_conf, new_conf = old["configurations"], new["configurations"]
    names = list(old_conf) + [name for name in new_conf if name not in old_conf]
    differ = 0
    for name in names:
        if name not in new_conf or name not in old_conf:
            verdict = f"DIFFERENT: only in {'old' if name in old_conf else 'new'}"
        else:
            where = step_difference(old_conf[name], new_conf[name])
            verdict = (f"DIFFERENT at {where}" if where
                       else f"identical ({len(old_conf[name])} steps)")
        differ += verdict.startswith("DIFFERENT")
        print(f"{name}: {verdict}")
    if changed or differ:
        print(f"DIFFERENT: {differ} of {len(names)} configurations"
              + (", and input files" if changed else ""))
        return False
    print(f"identical: all {len(names)} configurations and {len(old_files)} files")
    return True


# -----------------------------------------------------------------------------
# Command line


def write_recording(recording: dict, path: str) -> None:
    """Write under a temporary name and rename: a failed write leaves no half recording."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(recording, f, indent=1)  # one field a line: a plain diff shows the change
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:  # Ctrl-C too: no temporary file is left behind
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def record_into(path: str, work: str | None) -> None:
    t0 = time.perf_counter()
    if work is None:
        with tempfile.TemporaryDirectory(prefix="record_behaviour_") as tmp:
            recording = record(tmp)
    else:
        if os.path.exists(work) and (not os.path.isdir(work) or os.listdir(work)):
            raise ValueError(f"--work {work} is not an empty directory; give a new or empty one "
                             "(it is kept)")
        os.makedirs(work, exist_ok=True)
        recording = record(work)
    write_recording(recording, path)
    steps = sum(len(records) for records in recording["configurations"].values())
    print(f"recorded {len(recording['configurations'])} configurations, {steps} steps, "
          f"{len(recording['files'])} input files to {path} in {time.perf_counter() - t0:.1f}s")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scripts.record_behaviour",
                                     description=__doc__.split("\n\n")[0])  # the first paragraph
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record",
                         help="build the inputs, run every configuration, write the recording")
    rec.add_argument("out",
                     help="the recording to write (JSON; an existing file is kept unless --force)")
    rec.add_argument("--work", default=None,
                     help="build the inputs here (a new or empty directory, kept) instead of a "
                          "temporary directory")
    rec.add_argument("--force", action="store_true", help="replace an existing recording at OUT")
    cmp = sub.add_parser("compare", help="compare two recordings; exit 1 on any difference")
    cmp.add_argument("old")
    cmp.add_argument("new")
    chk = sub.add_parser("check", help="record anew into a temporary file and compare with OLD")
    chk.add_argument("old")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # the loaders run in this process (a worker process yields the same batches, as
    # tests/data/loader/test_worker.py checks, but costs ~2 s to start for each of the hundreds of
    # loaders built here); NANOCHAT_LOADER_WORKERS=1 records through the worker, in ~3 minutes
    os.environ.setdefault("NANOCHAT_LOADER_WORKERS", "0")
    print(" ".join(f"{k}={v}" for k, v in vars(args).items()))
    try:
        if args.command == "record":
            if os.path.exists(args.out) and not args.force:
                raise FileExistsError(f"{args.out} exists; record to another file, or pass --force "
                                      "to replace it")
            if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
                raise FileNotFoundError(f"the directory of {args.out} does not exist; create it "
                                        "first")
            record_into(args.out, args.work)
            return 0
        if args.command == "compare":
            old, new = load_recording(args.old), load_recording(args.new)
            return 0 if compare(old, new, args.old, args.new) else 1
        old = load_recording(args.old)  # check: a bad OLD fails before anything is recorded
        with tempfile.TemporaryDirectory(prefix="record_behaviour_") as tmp:
            new_path = os.path.join(tmp, "new.json")
            record_into(new_path, None)
            return 0 if compare(old, load_recording(new_path), args.old, "(recorded now)") else 1
    except (ValueError, OSError) as e:  # FileNotFoundError and FileExistsError are OSErrors
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    run(main, "record_behaviour stopped; it writes a recording whole or not at all: rerun it")

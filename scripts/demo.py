"""
The whole data pipeline end to end on a built-in sample, offline: ~6s on 2 CPU cores with the
defaults (4000 documents, 4+1 shards of ~470KB, a 2048-token vocab, 40 batches of 8x512).

    python -m scripts.demo                      # into a fresh temp dir (printed)
    python -m scripts.demo --out /tmp/nc-demo   # or a directory of your choice (must be empty)

Each stage is the real code that speedrun.sh runs: 1. write a seeded English-like corpus as shards
named like the hosted dataset; 2. serve them on 127.0.0.1 (nanochat/data/fetch/serve.py); 3.
download them with `python -m nanochat.dataset`; 4. train and measure a tokenizer
(scripts.tok_train, scripts.tok_eval); 5. stream best-fit packed batches on the CPU; 6. stream the
same batches from the server (stream=True) into a cache smaller than the shards and check they equal
step 5's. --out is laid out like $NANOCHAT_BASE_DIR plus hosted/ and stream_cache/; nothing under
~/.cache/nanochat is read or written. The demo ends with the lines that point your own scripts at
it: export NANOCHAT_BASE_DIR=OUT, then get_tokenizer() and a loader given no data_dir.
"""

import argparse
import hashlib
import json
import math
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time

import pyarrow.parquet as pq

from nanochat.data.streaming.cache_status import describe
from nanochat.data.base.cli import run
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.data.base.datasets import get_dataset, index_to_filename
from nanochat.data.fetch.repackage import repackage
from nanochat.data.streaming.budget import copies_estimate
from nanochat.data.base.state import decode_keys
from nanochat.tokenizer import RustBPETokenizer
from nanochat.data.fetch.serve import ShardServer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what a script of yours runs on the demo's base dir: get_tokenizer() and a loader given no
# data_dir find its tokenizer/ and shards there, once NANOCHAT_BASE_DIR names it
REUSE = ("from nanochat.tokenizer import get_tokenizer; "
         "from nanochat.dataloader import tokenizing_distributed_data_loader_bos_bestfit as L; "
         "x, y = next(L(get_tokenizer(), B={B}, T={T}, split=\"train\", device=\"cpu\")); "
         "print(x.shape)")

# -----------------------------------------------------------------------------
# 1. A sample corpus

# ~300 common English words, roughly most frequent first: a Zipf draw over them gives text whose
# word frequencies look like real prose, so BPE learns real-looking merges ("the", "ing", " of")
WORDS = """
the of and to a in is it that was for on are as with he they at be this from have or by one had
not but what all were when we there can an your which their said if do will each about how up out
them then she many some so these would other into has more her two like him see time could no make
than first been its who now people my made over did down only way find use may water long little
very after words called just where most know get through back much before go good new write our
used me man too any day same right look think also around another came come work three word must
because does part even place well such here take why things help put years different away again
off went old number great tell men say small every found still between name should home big give
air line set own under read last never us left end along while might next sound below saw something
thought both few those always looked show large often together asked house world going want school
important until form food keep children feet land side without boy once animals life enough took
four head above kind began almost live page got earth need far hand high year mother light country
father let night picture being study second soon story since white ever paper hard near sentence
better best across during today however sure knew try told young sun thing whole hear example heard
several change answer room sea against top turned learn point city play toward five himself usually
money seen car morning body upon family later turn move face door cut done group true leave color
""".split()
ZIPF_EXPONENT = 1.1  # word frequency ~ 1 / rank^1.1, close to what English corpora show
# the rare tail: made-up words from English-like syllables (names, jargon). Without it BPE runs out
# of pairs to merge after ~1600 tokens; with it a 2048 vocab fills up.
TAIL_WORDS = 4000
ONSETS = "b c d f g h j k l m n p r s t v w br ch cl cr dr fl gr pl pr sh st th tr".split()
NUCLEI = "a e i o u ai ea ee oo ou".split()
CODAS = ["", "", "", "n", "r", "s", "t", "l", "nd", "st", "ng", "ck"]
SUFFIXES = ["", "", "", "s", "ed", "ing", "er", "ly", "tion", "ness"]
# words per document ~ log-normal, median 150 (~900 characters)
WORDS_MEDIAN, WORDS_SIGMA = 150, 0.9


def _vocabulary() -> list[str]:
    """The common words, then TAIL_WORDS made-up ones; the same list every run."""
    rng = random.Random(1234)  # fixed: the language stays the same whatever --seed picks
    tail = set()
    while len(tail) < TAIL_WORDS:
        syllables = rng.choices([1, 2, 3], weights=[2, 5, 3])[0]
        word = "".join(rng.choice(ONSETS) + rng.choice(NUCLEI) + rng.choice(CODAS)
                       for _ in range(syllables))
        tail.add(word + rng.choice(SUFFIXES))
    return WORDS + sorted(tail - set(WORDS))


def _sentence(rng: random.Random, vocabulary: list[str], weights: list[float]) -> str:
    words = rng.choices(vocabulary, cum_weights=weights, k=rng.randint(4, 18))
    if rng.random() < 0.15:  # a number now and then, so digits get tokens too
        words.insert(rng.randrange(len(words)), str(rng.randint(2, 2024)))
    if len(words) > 8 and rng.random() < 0.3:
        words[len(words) // 2] += ","
    return " ".join(words).capitalize() + rng.choice(".....?!")


def generate_documents(num_docs: int, seed: int = 0) -> list[str]:
    """num_docs English-like documents (paragraphs of sentences), the same for the same seed."""
    rng = random.Random(seed)
    vocabulary = _vocabulary()
    weights, total = [], 0.0
    for rank in range(1, len(vocabulary) + 1):
        total += rank ** -ZIPF_EXPONENT
        weights.append(total)
    docs = []
    for _ in range(num_docs):
        target = min(int(rng.lognormvariate(math.log(WORDS_MEDIAN), WORDS_SIGMA)) + 5, 5000)
        paragraphs, sentences, words = [], [], 0
        while words < target:
            sentence = _sentence(rng, vocabulary, weights)
            sentences.append(sentence)
            words += sentence.count(" ") + 1
            if len(sentences) >= rng.randint(3, 7):
                paragraphs.append(" ".join(sentences))
                sentences = []
        if sentences:
            paragraphs.append(" ".join(sentences))
        docs.append("\n\n".join(paragraphs))
    return docs


def write_hosted_shards(
    docs: list[str], hosted_dir: str, num_train: int, row_group_size: int
) -> list[str]:
    """Shuffle docs into num_train train shards plus a val shard, named like the hosted dataset."""
    jsonl = os.path.join(os.path.dirname(hosted_dir), "sample.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        for text in docs:
            f.write(json.dumps({"text": text}) + "\n")
    # repackage splits as evenly as it can into ceil(num_docs / docs_per_shard) shards, the last is
    # val
    try:
        paths = repackage([jsonl], hosted_dir,
                          docs_per_shard=math.ceil(len(docs) / (num_train + 1)),
                          row_group_size=row_group_size, progress=False)
    finally:
        os.remove(jsonl)
    if len(paths) != num_train + 1:
        raise ValueError(f"--num-docs {len(docs)} does not split into {num_train} train shards "
                         f"+ 1 val shard (got {len(paths)} shards); pass more documents or fewer "
                         f"--shards")
    # the real CLI always fetches the dataset's last index as val, so the sample's val goes there
    val_path = os.path.join(hosted_dir, index_to_filename(get_dataset().max_shard))
    os.replace(paths[-1], val_path)
    return paths[:-1] + [val_path]


# -----------------------------------------------------------------------------
# 3-4. The real command-line tools


def run_cli(args: list[str], env: dict) -> None:
    """Run `python -m ...` from the repo root like a user would; raise if it fails."""
    print(f"\n$ python -m {' '.join(args)}", flush=True)
    # a session of its own: Ctrl-C reaches the demo alone, which ends it (subprocess.run kills it)
    # and says so once, rather than each command saying how to rerun itself
    result = subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, env=env,
                            start_new_session=True)
    if result.returncode != 0:
        raise RuntimeError(f"`python -m {' '.join(args)}` exited with status {result.returncode}")


# -----------------------------------------------------------------------------
# 5. Packed batches


def stream_batches(
    tokenizer, B: int, T: int, split: str, num_batches: int, data_dir: str, **loader_kwargs
) -> dict:
    """Pull num_batches batches from the best-fit loader on the CPU (loader_kwargs: e.g.
    stream=True and its settings) and measure them; a sha256 of all of them tells two runs'
    batches apart."""
    bos = tokenizer.get_bos_token_id()
    t0 = time.perf_counter()
    loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tokenizer, B, T, split, tokenizer_threads=2, device="cpu", data_dir=data_dir,
        **loader_kwargs)
    docs_per_row, bos_rows, first_row, state_dict, digest = [], 0, None, None, hashlib.sha256()
    try:
        for step, (inputs, targets, state_dict) in enumerate(loader):
            # the tensors are views that the next batch overwrites: measure now, copy what we keep
            if step == 0:
                first_s = time.perf_counter() - t0
            digest.update(inputs.numpy().tobytes() + targets.numpy().tobytes())
            if not (inputs[:, 1:] == targets[:, :-1]).all():
                raise AssertionError(f"{split} batch {step}: targets are not inputs shifted by one")
            bos_rows += int((inputs[:, 0] == bos).sum())
            # each document in a row starts with BOS; the row is inputs plus the last target (T + 1)
            docs_per_row += ((inputs == bos).sum(dim=1) + (targets[:, -1] == bos)).tolist()
            if first_row is None:
                first_row = inputs[0].tolist()
            if step + 1 == num_batches:
                break
        seconds = time.perf_counter() - t0
        status = loader.cache_status()  # a streaming loader's shard cache figures, else None
        figures = loader.figures()  # wait, tokens/s, crop and masked shares, downloads, evictions
    finally:
        loader.close()
    rows = num_batches * B
    return {
        "batches": num_batches, "rows": rows, "tokens": rows * T, "seconds": seconds,
        "first_s": first_s, "bos_row_pct": 100.0 * bos_rows / rows,
        "docs_per_row_mean": sum(docs_per_row) / rows, "docs_per_row_max": max(docs_per_row),
        "state_dict": state_dict, "first_row": first_row, "digest": digest.hexdigest(),
        # the loader's counts of tokens and crops, and its figures
        "loader_stats": loader.stats, "figures": figures,
        "peak_bytes": status and status.peak_bytes, "cache_status": status,
    }


def print_batch_stats(name: str, s: dict) -> None:
    print(f"{name}: {s['batches']} batches, {s['rows']} rows, {s['tokens']:,} tokens in "
          f"{s['seconds']:.2f}s ({s['tokens'] / max(s['seconds'], 1e-9):,.0f} tokens/s, "
          f"including start-up)")
    print(f"{name}: rows starting with BOS: {s['bos_row_pct']:.1f}%")
    print(f"{name}: documents per row: mean {s['docs_per_row_mean']:.2f}, "
          f"max {s['docs_per_row_max']}")
    stats = s["loader_stats"]
    # cropped / (emitted + cropped): the share of the documents the packer took that was thrown
    # away. tokens_tokenized is not the denominator: it also counts the documents still waiting
    # in the buffer and those read ahead.
    print(f"{name}: crop share: {stats['crop_share']:.1%} ({stats['tokens_cropped']:,} cropped, "
          f"{stats['tokens_emitted']:,} packed; {stats['tokens_tokenized']:,} tokenized so far)")
    print(f"{name} {s['figures']}")  # ("train loader: wait ...", rounded)
    state = s["state_dict"]
    position = {k: state[k] for k in ("pq_idx", "rg_idx", "epoch")}
    print(f"{name}: state_dict of the last batch: {position} + the exact-resume part: "
          f"{len(decode_keys(state['buffer']))} buffered documents by position, "
          f"emitted hash {state['emitted']['hash'][:12]}..., "
          f"{len(json.dumps(state)):,} bytes as JSON")


# -----------------------------------------------------------------------------
# 6. Training straight from the server


def demo_loader(args) -> dict:
    """Steps 5 and 6's loader settings for the sample's small shards (a few hundred documents
    each): a best-fit buffer of an eighth of a shard's documents, so that copies of the buffered
    documents (what a streaming loader keeps of the shards it evicts) take a fraction of one; and a
    read-ahead (prefetch=1, tokenizer batches of 12) within a shard, so that at most 2 shards are
    between the one packed and the one read."""
    return dict(buffer_size=max(8, args.num_docs // (args.shards + 1) // 8), prefetch=1,
                tokenizer_batch_size=12)


def stream_from_server(
    tokenizer, args, hosted: list[str], cache_dir: str
) -> tuple[dict, dict, int, list[str]]:
    """Step 5's train batches, then its val batch, again: each shard fetched from a server on
    127.0.0.1 just before it is read (stream=True), into cache_dir, within a cache_limit a little
    above the least that prefetch_shards=0 accepts (README: "The least cache_limit"): 3 x the
    largest train shard (the one read, the one still being packed, one for a rank out of
    step), the val shard at its size, and the room set aside for copies of buffered documents;
    less than the train and val shards together from 4 train shards on. Returns the train and val
    results of stream_batches, cache_limit and the shards downloaded, in order."""
    val_path = [path for path in hosted
                if os.path.basename(path) == get_dataset().val_filename][0]
    train_paths = [path for path in hosted if path != val_path]
    entries = [{"size": os.path.getsize(path), "rows": [pq.read_metadata(path).num_rows]}
               for path in train_paths]
    cache_limit = (3 * max(entry["size"] for entry in entries) + os.path.getsize(val_path)
                   + copies_estimate(entries, demo_loader(args)["buffer_size"]))
    server = ShardServer(os.path.dirname(hosted[0]))
    kwargs = dict(stream=True, cache_limit=cache_limit, prefetch_shards=0, num_shards=args.shards,
                  base_url=server.url, **demo_loader(args))
    try:
        train = stream_batches(tokenizer, args.B, args.T, "train", args.batches, cache_dir,
                               **kwargs)
        val = stream_batches(tokenizer, args.B, args.T, "val", 1, cache_dir, **kwargs)
    finally:
        server.close()
    return train, val, cache_limit, server.fetched()


# -----------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m scripts.demo",
        description="Run the data pipeline end to end on a built-in sample, offline")
    parser.add_argument("--out", default=None,
                        help="empty or new directory for hosted/, base_data_climbmix/, tokenizer/, "
                             "stream_cache/ (default: a fresh temp dir)")
    parser.add_argument("--num-docs", type=int, default=4000,
                        help="documents in the sample (default: 4000)")
    parser.add_argument("--shards", type=int, default=4,
                        help="train shards; one val shard is added (default: 4)")
    parser.add_argument("--row-group-size", type=int, default=256,
                        help="documents per row group (default: 256; the hosted shards use 1024)")
    parser.add_argument("--vocab-size", type=int, default=2048,
                        help="tokenizer vocab size (default: 2048)")
    parser.add_argument("--batches", type=int, default=40,
                        help="train batches to stream (default: 40)")
    parser.add_argument("--B", type=int, default=8, help="rows per batch (default: 8)")
    parser.add_argument("--T", type=int, default=512, help="tokens per row (default: 512)")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed (default: 0)")
    args = parser.parse_args(argv)
    for name in ("num_docs", "shards", "row_group_size", "batches", "B", "T"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_docs < 2 * (args.shards + 1):
        parser.error(f"--num-docs {args.num_docs} is too few for {args.shards} train shards "
                     f"+ 1 val shard; pass at least {2 * (args.shards + 1)}")
    # train shards are 0 .. max_shard-1, val is max_shard
    if args.shards >= get_dataset().max_shard:
        parser.error(f"--shards must be < {get_dataset().max_shard}, got {args.shards}")
    if args.out and os.path.isdir(args.out) and os.listdir(args.out):
        parser.error(f"--out {args.out} is not empty; pass a new or empty directory")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = os.path.abspath(args.out) if args.out else tempfile.mkdtemp(prefix="nanochat-demo-")
    hosted_dir, data_dir, tokenizer_dir = (os.path.join(out, d)
                                           for d in ("hosted", get_dataset().subdir, "tokenizer"))
    os.makedirs(out, exist_ok=True)
    print(f"out: {out}")
    print(f"num_docs: {args.num_docs}  shards: {args.shards} (+1 val)  "
          f"row_group_size: {args.row_group_size}  vocab_size: {args.vocab_size}  "
          f"batches: {args.batches}  B: {args.B}  T: {args.T}  seed: {args.seed}")
    t_start = time.perf_counter()
    # the tools find the shards and tokenizer/ under here by default; --data-dir etc. are still
    # passed
    env = dict(os.environ, NANOCHAT_BASE_DIR=out)

    print("\n== 1. sample corpus -> shards")
    docs = generate_documents(args.num_docs, args.seed)
    hosted = write_hosted_shards(docs, hosted_dir, args.shards, args.row_group_size)
    chars = sum(len(d) for d in docs)
    print(f"{len(docs):,} documents, {chars:,} characters ({chars / len(docs):,.0f} per document); "
          f"{len(hosted)} shards in {hosted_dir}:")
    for path in hosted:
        pf = pq.ParquetFile(path)
        print(f"  {os.path.basename(path)}: {pf.metadata.num_rows} documents, "
              f"{pf.num_row_groups} row groups, {os.path.getsize(path) / 1e3:.0f} KB")

    print("\n== 2-3. serve them on 127.0.0.1 and download with the real CLI")
    server = ShardServer(hosted_dir)
    url = server.url
    try:
        print(f"serving {hosted_dir} at {url}")
        run_cli(["nanochat.dataset", "-n", str(args.shards), "-w", "2", "--base-url", url,
                 "--data-dir", data_dir, "--backoff-base", "0.1"], env)
    finally:
        server.close()
    for path in hosted:
        with open(path, "rb") as a, open(os.path.join(data_dir, os.path.basename(path)), "rb") as b:
            if a.read() != b.read():
                raise RuntimeError(f"{b.name} differs from the served {a.name}")
    print(f"all {len(hosted)} downloaded shards are byte-identical to the served ones")

    print("\n== 4. tokenizer")
    run_cli(["scripts.tok_train", "--vocab-size", str(args.vocab_size), "--max-chars", str(chars),
             "--data-dir", data_dir, "--out-dir", tokenizer_dir], env)
    run_cli(["scripts.tok_eval", "--tokenizer-dir", tokenizer_dir, "--data-dir", data_dir,
             "--max-docs", "500", "--compare", "none"], env)
    tokenizer = RustBPETokenizer.from_directory(tokenizer_dir)

    print("\n== 5. best-fit packed batches (device=cpu)")
    train = stream_batches(tokenizer, args.B, args.T, "train", args.batches, data_dir,
                           **demo_loader(args))
    val = stream_batches(tokenizer, args.B, args.T, "val", 1, data_dir, **demo_loader(args))
    print_batch_stats("train", train)
    print_batch_stats("val", val)
    snippet = tokenizer.decode(train["first_row"][:60])
    print(f"first train row, first 60 tokens decoded: {snippet!r}")
    if train["bos_row_pct"] != 100.0 or val["bos_row_pct"] != 100.0:
        raise AssertionError("a row does not start with BOS; best-fit rows must always start "
                             "with one")

    print("\n== 6. the same batches, streamed from the server within a cache_limit (stream=True)")
    cache_dir = os.path.join(out, "stream_cache", get_dataset().subdir)
    streamed_train, streamed_val, cache_limit, downloads = stream_from_server(
        tokenizer, args, hosted, cache_dir)
    for split, streamed, on_disk in (("train", streamed_train, train),
                                     ("val", streamed_val, val)):
        if ((streamed["digest"], streamed["state_dict"])
                != (on_disk["digest"], on_disk["state_dict"])):
            raise AssertionError(f"the {split} batches streamed into {cache_dir} differ from "
                                 f"step 5's")
    peak = max(streamed_train["peak_bytes"], streamed_val["peak_bytes"])
    if peak > cache_limit:
        raise AssertionError(f"the shards in {cache_dir} took {peak:,} bytes, over "
                             f"cache_limit={cache_limit:,}")
    print(f"stream=True: {args.batches} train batches and 1 val batch equal to step 5's "
          f"(batches and states); first train batch after {streamed_train['first_s']:.2f}s "
          f"(on disk: {train['first_s']:.2f}s); peak cache "
          f"{peak:,} bytes <= cache_limit {cache_limit:,} bytes (the {len(hosted)} shards: "
          f"{sum(os.path.getsize(path) for path in hosted):,} bytes); shards downloaded, in order: "
          f"{', '.join(name.removesuffix('.parquet') for name in downloads)}")
    print(f"streamed train {streamed_train['figures']}")  # (with its downloads and evictions)
    print("the cache after the train batches, as `python -m nanochat.shard_cache status` shows it:")
    print(describe(streamed_train["cache_status"]))

    print("\n== summary")
    print(f"sample: {len(docs):,} documents, {chars:,} characters -> {len(hosted)} shards "
          f"served at {url}")
    print(f"downloaded: {len(hosted)}/{len(hosted)} shards to {data_dir}, byte-identical")
    print(f"tokenizer: vocab {tokenizer.get_vocab_size():,} saved to {tokenizer_dir}")
    print(f"loader: {train['batches']} train batches of {args.B}x{args.T}, "
          f"{train['tokens'] / max(train['seconds'], 1e-9):,.0f} tokens/s, 100% BOS rows, "
          f"{train['docs_per_row_mean']:.2f} documents per row")
    print(f"streamed: the same batches straight from the server into {cache_dir}, "
          f"within cache_limit={cache_limit:,} bytes")
    print(f"done in {time.perf_counter() - t_start:.1f}s; everything is under {out}")
    print(f"base dir: {out}. Your scripts find its tokenizer/ and {get_dataset().subdir}/ "
          "(get_tokenizer(), the loaders given no data_dir) once NANOCHAT_BASE_DIR names it:")
    print(f"  export NANOCHAT_BASE_DIR={shlex.quote(out)}")
    print(f"  python -c {shlex.quote(REUSE.format(B=args.B, T=args.T))}")
    return 0


if __name__ == "__main__":
    run(main, "the demo stopped; what it made so far is in the out directory it printed first: "
              "run it again with a new --out, or none (it starts over)",
        (ValueError, OSError, RuntimeError, AssertionError), error_status=1)

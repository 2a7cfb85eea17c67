"""
Loader benchmark: where the time goes, ours vs nanochat's algorithm, on one corpus in one run.

    python -m scripts.bench_dataloader                 # generated FineWeb-like corpus, B=32, T=2048
    python -m scripts.bench_dataloader --data-dir DIR  # your shards (train = all but the last)
    python -m scripts.bench_dataloader --only ratio    # the whole loader vs its tokenizer alone

It prints tokens/s for reading, tokenization and packing alone and for the whole loader, ours and
the slow oracle's (tests/oracle.py, nanochat's list-and-scan best-fit), then the target ratios, the
crop share over a long run, pretokenized shards, the long-document policies and memory. Speed is a
measurement here, never a test assertion. The default corpus: log-normal document lengths (median
~600 tokens, a tail past 20,000) of Zipf-distributed pseudo-English, written as real shards, and a
BPE trained on it (vocab 16,384, so uint16 storage as with nanochat's 65,536).
"""

import argparse
import os
import resource
import sys
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq

from nanochat.data.base.cli import run
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.data.base.datasets import read_row_group_texts, split_parquet_files
from nanochat.data.base.packing import BestFitPacker, token_dtype
from nanochat.data.loader.rows import to_documents
from nanochat.data.pretokenized.token_reader import check_ids
from nanochat.tokenizer import RustBPETokenizer
from scripts.list_tokenizer import ListTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))  # tests/ is no package: its modules by path
import oracle  # noqa: E402  the same slow reference the tests compare against

# -----------------------------------------------------------------------------
# A FineWeb-like corpus


def make_vocabulary(rng: np.random.Generator, n_words: int = 20_000) -> np.ndarray:
    """Pseudo-English words from syllables; index 0 is the most frequent."""
    onsets = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "w", "th", "st",
              "pr", "ch"]
    vowels = ["a", "e", "i", "o", "u", "ea", "ou", "io"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "ng", "ck", "st"]
    words = set()
    while len(words) < n_words:
        k = rng.integers(1, 4)
        words.add("".join(onsets[rng.integers(len(onsets))] + vowels[rng.integers(len(vowels))]
                          + codas[rng.integers(len(codas))] for _ in range(k)))
    return np.array(sorted(words, key=len))  # short words are the frequent ones, as in English


def make_corpus(num_docs: int, seed: int = 0) -> list[str]:
    """Documents of log-normal length (in words): median ~480 words ~ 600 tokens, mean ~1,000
    tokens."""
    rng = np.random.default_rng(seed)
    vocab = make_vocabulary(rng)
    # ln-normal with median 600 and mean 1000 tokens: sigma^2 = 2 ln(1000/600); ~1.25 tokens per
    # word
    sigma = np.sqrt(2 * np.log(1000 / 600))
    n_tokens = np.exp(rng.normal(np.log(600), sigma, size=num_docs))
    n_words = np.maximum(1, (n_tokens / 1.25).astype(np.int64))
    # Zipf's exponent 1.15: a heavy tail of rare words, as in web text; the tail is capped
    ranks = np.minimum(rng.zipf(1.15, size=int(n_words.sum())) - 1, len(vocab) - 1)
    words = vocab[ranks]
    # punctuation and digits, so the split pattern and merges have realistic work to do
    ends = rng.random(len(words))
    words = np.where(ends < 0.06, np.char.add(words, "."),  # 6% end a sentence, 3% a clause
                     np.where(ends < 0.09, np.char.add(words, ","), words))
    numbers = rng.random(len(words)) < 0.01
    words[numbers] = rng.integers(0, 100_000, size=int(numbers.sum())).astype(str)
    docs, start = [], 0
    for n in n_words:
        docs.append(" ".join(words[start:start + n]).capitalize())
        start += n
    return docs


def write_corpus(docs: list[str], data_dir: str, docs_per_shard: int = 4096) -> None:
    """Real-format shards: one text column, zstd, row groups of 1024; the last shard is val."""
    import pyarrow as pa
    os.makedirs(data_dir, exist_ok=True)
    # the val shard repeats the first 1,024 documents: nothing here measures val
    shards = ([docs[i:i + docs_per_shard] for i in range(0, len(docs), docs_per_shard)]
              + [docs[:1024]])
    for i, texts in enumerate(shards):
        pq.write_table(pa.table({"text": texts}), os.path.join(data_dir, f"shard_{i:05d}.parquet"),
                       row_group_size=1024, compression="zstd")  # as the hosted shards


# -----------------------------------------------------------------------------
# Measurements


def timed(fn):
    """(result, wall seconds)."""
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def cpu_timed(fn):
    """(result, wall seconds, CPU seconds of this process, all threads)."""
    c0, t0 = time.process_time(), time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0, time.process_time() - c0


def read_all(paths) -> list[list[str]]:
    batches = []
    for path in paths:
        pf = pq.ParquetFile(path)
        for rg_idx in range(pf.num_row_groups):
            batches.append(read_row_group_texts(pf, rg_idx, path))
    return batches


def tokenize_all(encode, bos, text_batches, batch_size, threads) -> list:
    out = []
    for texts in text_batches:
        for i in range(0, len(texts), batch_size):
            out.extend(encode(texts[i:i + batch_size], prepend=bos, num_threads=threads))
    return out


def cycled(items, batch):
    """A refill callable that cycles over a list forever, `batch` items at a time."""
    state = {"i": 0}  # a dict: the closure below rebinds nothing

    def refill():
        i = state["i"]
        chunk = [items[(i + j) % len(items)] for j in range(batch)]
        state["i"] = (i + batch) % len(items)
        return chunk

    return refill


def pack_ours(docs, B, T, buffer_sizes, n_batches, batch, *, rounds=5):
    """Seconds per buffer size to pack n_batches, the sizes alternating in `rounds` rounds so that
    the machine's drift hits them alike. Each packer's first fill is start-up and is not timed."""
    rows = np.empty((B, T + 1), dtype=np.uint16 if docs[0].dtype == np.uint16 else np.uint32)
    packers = {}
    for size in buffer_sizes:
        # (doc, key, overlap, start): what the loader's refill hands the packer
        packers[size] = (BestFitPacker(T + 1),
                         cycled([(doc, None, 0, None) for doc in docs], batch))
        packers[size][0].fill(rows, packers[size][1], size)  # start-up: the first fill
    seconds = dict.fromkeys(buffer_sizes, 0.0)
    for _ in range(rounds):
        for size, (packer, refill) in packers.items():
            t0 = time.perf_counter()
            for _ in range(n_batches // rounds):
                packer.fill(rows, refill, size)
            seconds[size] += time.perf_counter() - t0
    return seconds


def pack_oracle(docs, B, T, buffer_size, n_batches, batch):
    refill_items = cycled(docs, batch)
    doc_buffer = []

    def refill():
        doc_buffer.extend(refill_items())

    oracle.bestfit_rows(doc_buffer, refill, B, T + 1, buffer_size)  # warm-up fill
    t0 = time.perf_counter()
    for _ in range(n_batches):
        oracle.bestfit_rows(doc_buffer, refill, B, T + 1, buffer_size)
    return time.perf_counter() - t0


# -----------------------------------------------------------------------------
# The whole loader against its tokenizer alone


OURS, LISTS = "ours (encode_to_arrays -> numpy)", "lists (encode -> Python ints)"


def ratio_contenders(tokenizer: RustBPETokenizer) -> dict:
    """{label: (tokenizer, the method the loader calls)}: the tokenizers the loader is compared
    with."""
    return {OURS: (tokenizer, "encode_to_arrays"), LISTS: (ListTokenizer(tokenizer), "encode")}


def run_loader(tokenizer, method: str, n_batches: int, data_dir: str, args) -> tuple:
    """(tokens through the tokenizer, wall s, CPU s, consumer wait s) of n_batches from a fresh
    loader, after its start-up. On threads (--workers 0) tokens are counted as the loader pushes
    them through `method`, read-ahead included, as tokenization alone counts them. In a worker
    (the default) the tokenizer goes there by pickle, so the loader's own count is used, after a
    few batches: a consumer that never waits keeps its queues about as empty at the end as at the
    start. CPU counts this process and the worker."""
    if args.workers != 0:
        loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
            tokenizer, args.B, args.T, "train", tokenizer_threads=args.threads,
            tokenizer_batch_size=args.tokenizer_batch_size, device=args.device,
            data_dir=data_dir, rank=0, world_size=1, workers=args.workers)
        pid = loader.worker_pid
        assert pid is not None, "the loader did not start a worker"
        for _ in range(5):  # start-up: the first buffer fill
            next(loader)
        start, wait_start = loader.stats["tokens_tokenized"], loader.stats["wait_seconds"]
        c0, w0, t0 = time.process_time(), cpu_seconds(pid), time.perf_counter()
        for _ in range(n_batches):
            next(loader)
        if args.device.startswith("cuda"):
            import torch
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        cpu = time.process_time() - c0 + cpu_seconds(pid) - w0
        tokens = loader.stats["tokens_tokenized"] - start
        wait = loader.stats["wait_seconds"] - wait_start
        loader.close()
        return tokens, dt, cpu, wait
    counted = {"tokens": 0}
    encode = getattr(tokenizer, method)

    def counting_encode(texts, **kwargs):
        docs = encode(texts, **kwargs)
        counted["tokens"] += sum(len(d) for d in docs)
        return docs

    setattr(tokenizer, method, counting_encode)  # an instance attribute: the loader picks it up
    try:
        loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
            tokenizer, args.B, args.T, "train", tokenizer_threads=args.threads,
            tokenizer_batch_size=args.tokenizer_batch_size, device=args.device, data_dir=data_dir,
            rank=0, world_size=1, workers=0)
        next(loader)  # start-up: the first buffer fill
        start, wait_start = counted["tokens"], loader.stats["wait_seconds"]
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(n_batches):
            next(loader)
        if args.device.startswith("cuda"):
            import torch
            torch.cuda.synchronize()  # the last copies are queued, not done, until this returns
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens, wait = counted["tokens"] - start, loader.stats["wait_seconds"] - wait_start
        loader.close()
    finally:
        delattr(tokenizer, method)  # back to the class's method
    return tokens, dt, cpu, wait


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a process so far (0 for None), from /proc (Linux)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # (after the name, which may hold spaces)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def nanochat_seconds(tokenizer, data_dir: str, args) -> tuple[float, float]:
    """(seconds, of which in tokenizer.encode) nanochat's loader (its algorithm run in the caller:
    tests/oracle.py) takes for --oracle-batches batches, after its first (start-up). The share in
    encode bounds what any loader with the same tokenizer can emit against it: at best it
    tokenizes as fast as the tokenizer alone and hides the rest."""
    in_encode = [0.0]

    class Timed:  # the tokenizer, its encode calls timed
        def get_bos_token_id(self):
            return tokenizer.get_bos_token_id()

        def encode(self, texts, **kwargs):
            t0 = time.perf_counter()
            ids = tokenizer.encode(texts, **kwargs)
            in_encode[0] += time.perf_counter() - t0
            return ids

    reference = oracle.bestfit_loader(Timed(), split_parquet_files("train", data_dir), args.B,
                                      args.T, args.tokenizer_batch_size, 1000)
    next(reference)
    in_encode[0] = 0.0
    t0 = time.perf_counter()
    for _ in range(args.oracle_batches):
        next(reference)
    seconds = time.perf_counter() - t0
    reference.close()
    return seconds, in_encode[0]


def loader_vs_tokenizer(contenders: dict, text_batches, data_dir: str, args) -> dict:
    """{label: rounds}, each round (tokens, wall s, CPU s) of tokenization alone, then (tokens, wall
    s, CPU s, wait s) of the whole loader (reading + tokenizing + packing + transfer), with the
    loader's own encode method, then the seconds of nanochat's loader (nanochat_seconds). This
    2-core machine is shared and its speed drifts by +-15% from one second to the next, so the
    runs alternate, round after round, and are compared on their totals."""
    # tokenization alone takes, every round, the texts at the start of the corpus: about what a
    # fresh loader tokenizes in its timed batches (documents differ in how fast they tokenize)
    n_batches = args.loader_batches // args.repeats
    # 1.4: the loader tokenizes more than it emits (crops, and the buffer it keeps full)
    tokens_per_round = n_batches * args.B * (args.T + 1) * 1.4
    chunk, total = [], 0
    for texts in text_batches:
        chunk.append(texts)
        total += sum(len(t) for t in texts) / 4.3  # ~4.3 characters a token: only to size the chunk
        if total >= tokens_per_round:
            break
    rounds = {label: [] for label in contenders}
    for _ in range(args.repeats):
        for label, (tokenizer, method) in contenders.items():
            encode, bos = getattr(tokenizer, method), tokenizer.get_bos_token_id()
            docs, dt, cpu = cpu_timed(lambda: tokenize_all(encode, bos, chunk,
                                                           args.tokenizer_batch_size, args.threads))
            alone = sum(map(len, docs))
            del docs  # freed before the next contender's run, which would otherwise pay for it
            measured = run_loader(tokenizer, method, n_batches, data_dir, args)
            rounds[label].append((alone, dt, cpu, *measured,
                                   *nanochat_seconds(tokenizer, data_dir, args)))
    return rounds


def print_ratios(rounds: dict, n_batches: int, oracle_batches: int, row_tokens: int) -> None:
    """Per tokenizer: whole loader / tokenization alone, on the totals of all rounds (per wall
    second and per CPU-second, the latter immune to a noisy neighbour's steal), and each round's own
    ratio."""
    print("  whole loader / tokenization alone (tokens through the tokenizer per second; target >= "
          "0.9):")
    for label, rs in rounds.items():  # r: (tokens, wall, cpu) alone, then the loader's 4 figures
        tokens, wall, cpu = (sum(r[i] for r in rs) for i in (0, 1, 2))
        loader_tokens, loader_wall, loader_cpu = (sum(r[i] for r in rs) for i in (3, 4, 5))
        ratio = (loader_tokens / loader_wall) / (tokens / wall)
        cpu_ratio = (loader_tokens / loader_cpu) / (tokens / cpu)
        per_round = sorted((r[3] / r[4]) / (r[0] / r[1]) for r in rs)
        print(f"    {label:34s} {ratio:.2f}  per CPU-second {cpu_ratio:.2f}  per round (sorted) "
              f"{' '.join(f'{x:.2f}' for x in per_round)}, "
              f"median {per_round[len(per_round) // 2]:.2f}")
        print(f"    {'':34s} alone {tokens / wall / 1e6:.2f} M/s ({tokens / cpu / 1e6:.2f} M per "
              f"CPU-s), loader {loader_tokens / loader_wall / 1e6:.2f} M/s "
              f"({loader_tokens / loader_cpu / 1e6:.2f} M per CPU-s); "
              f"consumer wait {sum(r[6] for r in rs):.2f}s of {loader_wall:.2f}s")
    print("  tokens emitted per second, ours / nanochat's loader (its algorithm in the caller, run "
          "in each round; target >= 1.7):")
    for label, rs in rounds.items():
        ours = len(rs) * n_batches * row_tokens / sum(r[4] for r in rs)
        theirs = len(rs) * oracle_batches * row_tokens / sum(r[7] for r in rs)
        print(f"    {label:34s} {ours / theirs:.2f}x  ({ours / 1e6:.2f} M/s against "
              f"{theirs / 1e6:.2f} M/s)")
    print("  nanochat's loader: its share of time in tokenizer.encode, and the most any loader can "
          "emit against it at 1.0x the tokenizer alone (1 / share):")
    for label, rs in rounds.items():
        share = sum(r[8] for r in rs) / sum(r[7] for r in rs)
        print(f"    {label:34s} {share:.0%} in encode, so at most {1 / share:.2f}x")


POLICY_RUNS = [("crop", 0), ("split", 0), ("split", 128), ("split_reuse", 0), ("split_reuse", 128)]


def policy_section(docs_np, B, tbs, bos, crop_batches, Ts=(512, 2048, 4096)) -> list[tuple]:
    """The long-document policies on the same documents at several T: per (T, policy, overlap), the
    crop share, the slots spent on the BOS and overlap that start pieces, the share of emitted
    tokens whose own document starts in the same row, documents split, rows not starting with BOS,
    and the packing speed against nanochat's cropping at the same T. Every run packs the same number
    of tokens (crop_batches batches at T=2048), after one untimed fill."""
    results = []
    for T in Ts:
        n_batches = max(1, crop_batches * 2048 // T)
        rows = np.empty((B, T + 1), dtype=docs_np[0].dtype)
        for policy, overlap in POLICY_RUNS:
            packer = BestFitPacker(T + 1, policy, overlap)
            refill = cycled([(doc, None, 0, None) for doc in docs_np], tbs)
            packer.fill(rows, refill, 1000)
            not_bos, seconds = 0, 0.0
            for _ in range(n_batches):
                t0 = time.perf_counter()
                packer.fill(rows, refill, 1000)
                seconds += time.perf_counter() - t0
                not_bos += int((rows[:, 0] != bos).sum())
            s = packer.stats()
            results.append((T, policy, overlap, s["crop_share"],
                            s["tokens_cropped"] / s["tokens_tokenized"],
                            (s["tokens_bos_added"] + s["tokens_repeated"]) / s["tokens_emitted"],
                            s["doc_start_visible_share"], s["docs_split"], not_bos,
                            n_batches * B * (T + 1) / seconds))
    return results


def pretokenized_section(tokenizer, data_dir, tmp, docs_np, args) -> dict:
    """Pretokenize the train shards, time the pretokenized loader (without and with its check of the
    ids against the vocabulary, and the check alone), a memory copy, and the crop share of windowing
    (L = T+1, O = 0 and 128) next to nanochat's cropping."""
    B, T, tbs = args.B, args.T, args.tokenizer_batch_size
    from nanochat.dataloader import pretokenized_distributed_data_loader_with_state_bos_bestfit
    from nanochat.data.processing.tokenize_pair import pretokenize_file
    from nanochat.data.processing.windows import window_document
    from nanochat.data.pretokenized.token_shards import TokenShard
    from nanochat.data.base.layout import list_token_shards
    out = os.path.join(tmp, "tokens")
    t0 = time.perf_counter()
    for split in ("train", "val"):
        for path in split_parquet_files(split, data_dir):
            name = os.path.basename(path)[:-len(".parquet")]
            pretokenize_file(tokenizer, path, os.path.join(out, split, name),
                             num_threads=args.threads)
    pretokenize_s = time.perf_counter() - t0
    row_tokens = B * (T + 1)

    rounds = args.repeats
    n = max(args.loader_batches, 200) // rounds * rounds  # whole rounds, 200 batches at least
    loader_tps = {}
    vocab_size = tokenizer.get_vocab_size()
    # packing on its background thread (the default), and in the caller; each without and with the
    # check of the ids (pretokenize_file writes no pretokenize.json: the ids are checked when
    # vocab_size is passed), two loaders open at once and timed in alternating rounds, as the
    # machine drifts (and shuffled, with the check: shuffle=True against the same loader in file
    # order)
    for prefetch in (4, 0):
        loaders = {(check, shuffle): pretokenized_distributed_data_loader_with_state_bos_bestfit(
            B, T, "train", device=args.device, data_dir=out, batch_size=tbs, rank=0, world_size=1,
            prefetch=prefetch, vocab_size=vocab_size if check else None, shuffle=shuffle,
            bos_token=tokenizer.get_bos_token_id())
            for check, shuffle in ((False, False), (True, False), (True, True))}
        seconds = {key: 0.0 for key in loaders}
        for loader in loaders.values():
            next(loader)  # start-up, untimed
        for _ in range(rounds):
            for key, loader in loaders.items():
                t0 = time.perf_counter()
                for _ in range(n // rounds):
                    next(loader)
                seconds[key] += time.perf_counter() - t0
        for (check, shuffle), loader in loaders.items():
            loader_tps[prefetch, check, shuffle] = n * row_tokens / seconds[check, shuffle]
            loader.close()

    # the check alone, over every chunk of the train shards (as the loader reads them, 1,024
    # entries)
    shards = [TokenShard(prefix) for prefix in list_token_shards(os.path.join(out, "train"))]
    checked = sum(int(shard.offsets[-1]) for shard in shards)
    t0 = time.perf_counter()
    for shard in shards:
        for start in range(0, len(shard), 1024):
            check_ids(shard, start, min(start + 1024, len(shard)), vocab_size, "bench")
    check_tps = checked / (time.perf_counter() - t0)

    # a plain copy of as many uint16 tokens as the loader emitted, through memory (64 MB at a time)
    src = np.random.default_rng(0).integers(0, 2**16, size=32 * 2**20, dtype=np.uint16)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # the first copy pays for mapping dst's pages: not a copy cost
    copies = max(5, n * row_tokens // src.size)
    t0 = time.perf_counter()
    for _ in range(copies):
        np.copyto(dst, src)
    memcpy_tps = copies * src.size / (time.perf_counter() - t0)

    crop = []
    for name, windows in [("nanochat's cropping (no windows)", [(d, 0) for d in docs_np]),
                          ("windows L=T+1, O=0", None), ("windows L=T+1, O=128", None)]:
        if windows is None:
            overlap = 0 if name.endswith("O=0") else 128
            windows = [w for d in docs_np for w in window_document(d, T + 1, overlap)]
        packer = BestFitPacker(T + 1)
        refill = cycled([(doc, None, o, None) for doc, o in windows], tbs)
        rows = np.empty((B, T + 1), dtype=np.uint32)  # uint32 holds either token dtype
        for _ in range(args.crop_batches):
            packer.fill(rows, refill, 1000)
        stats = packer.stats()
        crop.append((name, stats["crop_share"],
                     stats["tokens_masked"] / (args.crop_batches * B * T)))
    return {"pretokenize_s": pretokenize_s, "loader_tps": loader_tps, "check_tps": check_tps,
            "memcpy_tps": memcpy_tps, "crop": crop,
            "spread": window_spread(tokenizer, data_dir, tmp, args, tbs)}


def window_spread(tokenizer, data_dir, tmp, args, tbs, *, L=257, overlap=32, B=16,
                  batches=300) -> dict:
    """How far apart consecutive windows of one document land, in file order and shuffled: the
    train shards cut into windows of L tokens (so that most documents have several), read by the
    pretokenized loader at T = L - 1 with trace_documents. Returns shuffle -> (share of pairs in the
    same batch, median distance in batches, pairs seen)."""
    from nanochat.dataloader import pretokenized_distributed_data_loader_with_state_bos_bestfit
    from nanochat.data.processing.tokenize_pair import pretokenize_file
    from nanochat.data.pretokenized.token_shards import TokenShard
    from nanochat.data.base.layout import list_token_shards
    out = os.path.join(tmp, "windows")
    for split in ("train", "val"):
        for path in split_parquet_files(split, data_dir):
            name = os.path.basename(path)[:-len(".parquet")]
            pretokenize_file(tokenizer, path, os.path.join(out, split, name), max_length=L,
                             overlap=overlap, num_threads=args.threads)
    shards = [TokenShard(prefix) for prefix in list_token_shards(os.path.join(out, "train"))]
    # a window with no overlap starts a document: the running count numbers the documents
    document = [np.cumsum(shard.overlaps == 0) for shard in shards]
    spread = {}
    for shuffle in (False, True):
        loader = pretokenized_distributed_data_loader_with_state_bos_bestfit(
            B, L - 1, "train", device="cpu", data_dir=out, batch_size=tbs, rank=0, world_size=1,
            prefetch=0, trace_documents=True, shuffle=shuffle,
            bos_token=tokenizer.get_bos_token_id())
        seen, distances = {}, []
        for step in range(batches):
            next(loader)
            for row in loader.documents:
                for key in row:
                    # the key's chunk and row within it; chunks of 1,024 entries, the default
                    entry = key[2] * 1024 + key[3]
                    doc = (key[1], int(document[key[1]][entry]))
                    if doc in seen and seen[doc][1] == entry - 1:  # the next window of a document
                        distances.append(step - seen[doc][0])
                    seen[doc] = (step, entry)
        loader.close()
        distances = np.array(distances)
        spread[shuffle] = (float(np.mean(distances == 0)), float(np.median(distances)),
                           len(distances))
    return spread


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_dataloader", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None,
                        help="shards to read (default: generate a corpus)")
    parser.add_argument("--tokenizer-dir", default=None,
                        help="a saved tokenizer (default: train one)")
    parser.add_argument("--num-docs", type=int, default=12_000,
                        help="documents in the generated corpus")
    parser.add_argument("--vocab-size", type=int, default=16_384)
    parser.add_argument("-B", type=int, default=32)
    parser.add_argument("-T", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=4,
                        help="tokenizer threads (the loader's default)")
    parser.add_argument("--tokenizer-batch-size", type=int, default=128)
    parser.add_argument("--loader-batches", type=int, default=400,
                        help="batches for the whole-loader runs, in all")
    parser.add_argument("--oracle-batches", type=int, default=20,
                        help="batches for the slow oracle runs")
    parser.add_argument("--crop-batches", type=int, default=3000,
                        help="batches for the long crop-share run")
    parser.add_argument("--repeats", type=int, default=8,
                        help="alternating rounds of tokenization alone and the loader")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--workers", type=int, choices=[0, 1], default=None,
                        help="the loader's workers (default: its own, a worker process)")
    parser.add_argument("--only", choices=["ratio"], default=None,
                        help="run one section: ratio = the whole loader against tokenization "
                             "alone, for our tokenizer and for one whose encode returns lists, as "
                             "nanochat's does")
    args = parser.parse_args(argv)
    print(f"bench_dataloader: {vars(args)}")
    B, T, threads, tbs = args.B, args.T, args.threads, args.tokenizer_batch_size

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir
        if data_dir is None:
            data_dir = os.path.join(tmp, "data")
            (docs, dt) = timed(lambda: make_corpus(args.num_docs))
            write_corpus(docs, data_dir)
            print(f"generated {len(docs):,} documents ({sum(map(len, docs)) / 1e6:.0f} MB of text) "
                  f"in {dt:.1f}s -> {data_dir}")
        if args.tokenizer_dir:
            tokenizer = RustBPETokenizer.from_directory(args.tokenizer_dir)
        else:
            # the first shard only: ~4,000 documents train a 16k vocab in seconds
            sample = (t for batch in read_all(split_parquet_files("train", data_dir)[:1])
                      for t in batch)
            tokenizer, dt = timed(lambda: RustBPETokenizer.train_from_iterator(sample,
                                                                               args.vocab_size))
            print(f"trained a {tokenizer.get_vocab_size():,}-token BPE on the first shard in "
                  f"{dt:.1f}s")
        train_paths = split_parquet_files("train", data_dir)

        # 1. reading alone, 2. tokenization alone (the same texts, the loader's batch size and
        # threads)
        text_batches, t_read = timed(lambda: read_all(train_paths))
        if args.only == "ratio":
            rounds = loader_vs_tokenizer(ratio_contenders(tokenizer), text_batches, data_dir, args)
            print(f"\nB={B} T={T} threads={threads} tokenizer_batch_size={tbs} "
                  f"device={args.device}")
            print_ratios(rounds, args.loader_batches // args.repeats, args.oracle_batches,
                         B * (T + 1))
            return
        # the loader's path (numpy arrays, no Python int per token), and plain encode() -> lists
        bos = tokenizer.get_bos_token_id()
        token_lists, t_tok_lists = timed(lambda: tokenize_all(tokenizer.encode, bos, text_batches,
                                                              tbs, threads))
        n_tokens = sum(map(len, token_lists))
        lengths = np.array([len(t) for t in token_lists])
        print(f"corpus: {len(lengths):,} train documents, {n_tokens:,} tokens; tokens per "
              f"document: mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, "
              f"p99 {np.percentile(lengths, 99):.0f}, max {lengths.max():,}")
        dtype = token_dtype(tokenizer.get_vocab_size())
        docs_np = to_documents(token_lists, tokenizer.get_bos_token_id(), dtype)

        # 3. packing alone, ours and the oracle's, on pre-tokenized documents (cycled)
        n_pack = max(args.oracle_batches * 50, 1000)  # ~1 s each: long enough to be stable
        seconds = pack_ours(docs_np, B, T, (1000, 10_000), n_pack, tbs)
        t_pack, t_pack10k = seconds[1000], seconds[10_000]
        n_pack = n_pack // 5 * 5  # what pack_ours ran: whole rounds of 5
        t_oracle_pack = pack_oracle(token_lists, B, T, 1000, args.oracle_batches, tbs)
        row_tokens = B * (T + 1)
        pack_tps = n_pack * row_tokens / t_pack
        pack10k_tps = n_pack * row_tokens / t_pack10k
        oracle_pack_tps = args.oracle_batches * row_tokens / t_oracle_pack

        # 4. the whole loader against tokenization alone, for our tokenizer and a list-returning one
        contenders = ratio_contenders(tokenizer)
        rounds = loader_vs_tokenizer(contenders, text_batches, data_dir, args)
        ours = rounds[OURS]
        t_loader = sum(r[4] for r in ours)
        tok_tps = sum(r[0] for r in ours) / sum(r[1] for r in ours)
        loader_tok_tps = sum(r[3] for r in ours) / t_loader
        loader_emit_tps = ((args.loader_batches // args.repeats) * args.repeats * row_tokens
                           / t_loader)
        wait = sum(r[6] for r in ours)
        lists = rounds[LISTS]
        lists_loader_tps = sum(r[3] for r in lists) / sum(r[4] for r in lists)

        reference = oracle.bestfit_loader(tokenizer, train_paths, B, T, tbs, 1000)
        next(reference)  # start-up, as for ours
        t0 = time.perf_counter()
        for _ in range(args.oracle_batches):
            next(reference)
        t_oracle_loader = time.perf_counter() - t0
        oracle_emit_tps = args.oracle_batches * row_tokens / t_oracle_loader

        # 5. the crop share over a long run (documents longer than a row pile up in the buffer)
        crop = []
        packer = BestFitPacker(T + 1)
        refill = cycled([(doc, None, 0, None) for doc in docs_np], tbs)
        rows = np.empty((B, T + 1), dtype=np.int64)
        checkpoints = {c for c in (10, 100, 1000, args.crop_batches) if c <= args.crop_batches}
        for k in range(1, args.crop_batches + 1):
            packer.fill(rows, refill, 1000)
            if k in checkpoints:
                s = packer.stats()
                crop.append((k, s["crop_share"], s["tokens_cropped"] / s["tokens_tokenized"],
                             s["buffer_docs"], s["buffer_tokens"]))
        # the packer's own buffers: a benchmark may look inside to weigh them
        buffered = ([d for q in packer._by_length.values() for _, d in q]
                    + [d for _, _, d in packer._long])
        buffer_bytes = sum(d.nbytes for d in buffered)
        # an array object's header, plus the (seq, doc) tuple and deque slot that index it
        per_doc_overhead = (sys.getsizeof(buffered[0]) - buffered[0].nbytes
                            + sys.getsizeof((0, 0)) + 8)

        # 6. pretokenized shards of the same corpus: the loader with no tokenizer in the loop,
        # against the parquet loader and against a plain memory copy of the same bytes (the
        # physical limit)
        pretok = pretokenized_section(tokenizer, data_dir, tmp, docs_np, args)

        # 7. the long-document policies, T = 512, 2048, 4096
        policies = policy_section(docs_np, B, tbs, bos, args.crop_batches)

    read_tps = n_tokens / t_read
    print()
    print(f"B={B} T={T} threads={threads} tokenizer_batch_size={tbs} device={args.device}")
    print(f"{'stage':42s} {'tokens/s':>14s}")
    for name, tps in [
        ("reading alone (parquet -> str)", read_tps),
        ("tokenization alone (arrays, the loader's)", tok_tps),
        ("tokenization alone (encode -> lists)", n_tokens / t_tok_lists),
        ("packing alone, ours, buffer 1,000", pack_tps),
        ("packing alone, ours, buffer 10,000", pack10k_tps),
        ("packing alone, oracle, buffer 1,000", oracle_pack_tps),
        ("whole loader, ours (tokens tokenized)", loader_tok_tps),
        ("whole loader, lists (tokens tokenized)", lists_loader_tps),
        ("whole loader, ours (tokens emitted)", loader_emit_tps),
        ("whole loader, oracle (tokens emitted)", oracle_emit_tps),
    ]:
        print(f"{name:42s} {tps:14,.0f}")
    print()
    print("ratios")
    print_ratios(rounds, args.loader_batches // args.repeats, args.oracle_batches, row_tokens)
    print(f"  packing / oracle packing (buffer 1,000):                    "
          f"{pack_tps / oracle_pack_tps:.1f}x  (target >= 20)")
    print(f"  packing cost at buffer 10,000 / at 1,000:                   "
          f"{t_pack10k / t_pack:.2f}  (target < 1.5)")
    print(f"  whole loader, ours / oracle (tokens emitted per s):         "
          f"{loader_emit_tps / oracle_emit_tps:.2f}x")
    print(f"  consumer wait in next() over the loader run: {wait:.2f}s of {t_loader:.2f}s")
    print()
    print("crop share over a long run (buffer 1,000; cropped / tokens consumed, cropped / tokens "
          "tokenized)")
    for k, share, share_tok, bdocs, btoks in crop:
        print(f"  after {k:5d} batches: {share:6.1%}  {share_tok:6.1%}   buffer {bdocs:,} docs, "
              f"{btoks:,} tokens")
    print()
    print()
    print("pretokenized .bin/.idx shards (same corpus, windowing off; python -m "
          "nanochat.pretokenize)")
    print(f"  pretokenize: {pretok['pretokenize_s']:.1f}s for the train shards")
    for (prefetch, check, shuffle), tps in pretok["loader_tps"].items():
        if shuffle:  # the shuffled runs get their own line below
            continue
        where = (("a background thread (default)" if prefetch else "the caller (prefetch=0)")
                 + (", ids checked" if check else ""))
        print(f"  pretokenized loader, packing on {where:43s} {tps:14,.0f} tokens emitted/s, "
              f"{tps / loader_emit_tps:.1f}x the parquet loader, "
              f"{tps / pretok['memcpy_tps']:.1%} of a memory copy")
    tps = pretok["loader_tps"]
    print(f"  the check of the ids against the vocabulary: loader speed with / without it "
          f"{tps[4, True, False] / tps[4, False, False]:.3f} (prefetch 4), "
          f"{tps[0, True, False] / tps[0, False, False]:.3f} (prefetch 0); "
          f"the check alone {pretok['check_tps'] / 1e6:,.0f} M tokens/s, its time per token / the "
          f"loader's (prefetch 0, without it): {tps[0, False, False] / pretok['check_tps']:.2%}")
    print(f"  shuffle=True (ids checked): loader speed shuffled / in file order "
          f"{tps[4, True, True] / tps[4, True, False]:.2f} (prefetch 4), "
          f"{tps[0, True, True] / tps[0, True, False]:.2f} (prefetch 0)   (target >= 0.8)")
    for shuffle, (same, median, pairs) in pretok["spread"].items():
        print(f"  consecutive windows of one document (L=257, O=32, read at T=256, B=16), "
              f"{'shuffled' if shuffle else 'file order'}: {same:.1%} in the same batch, "
              f"median {median:.0f} batches apart ({pairs:,} pairs)")
    print(f"  memory copy of the same bytes (uint16): {pretok['memcpy_tps']:14,.0f} tokens/s   "
          "(targets: >= 20x the parquet loader, >= 20 M tokens/s)")
    print(f"  crop share over {args.crop_batches:,} batches at T={T} (cropped / tokens consumed; "
          "masked overlap targets / targets):")
    for name, share, masked in pretok["crop"]:
        print(f"    {name:34s} {share:6.1%}   masked {masked:5.1%}")
    print()
    print(f"long_doc_policy (buffer 1,000; each run packs {args.crop_batches:,} batches' worth of "
          "T=2048 tokens; cropped: / tokens taken from the buffer, / tokens tokenized; added: "
          "piece BOS + overlap / emitted; start visible: emitted tokens whose own document starts "
          "in the row; speed: packing alone)")
    print(f"  {'T':>5s} {'policy':12s} {'overlap':>7s} {'cropped':>8s} {'/tokd':>7s} {'added':>7s} "
          f"{'start vis.':>10s} {'docs split':>10s} {'rows w/o BOS':>12s} {'tokens/s':>14s} "
          f"{'time vs crop':>12s}")
    crop_speed = {}
    for T, policy, overlap, share, share_tok, added, visible, split, not_bos, tps in policies:
        crop_speed.setdefault(T, tps)  # crop runs first at each T: the yardstick
        print(f"  {T:5d} {policy:12s} {overlap:7d} {share:8.2%} {share_tok:7.2%} {added:7.2%} "
              f"{visible:10.1%} {split:10,d} {not_bos:12d} {tps:14,.0f} "
              f"{crop_speed[T] / tps:11.2f}x")
    print("  (targets at T=2048 for a splitting policy: <= 5% of tokenized tokens cropped, every "
          "row starts with BOS, packing time within 1.5x of crop's)")
    # ru_maxrss is in KiB on Linux
    print(f"memory: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB "
          f"(whole process, corpus and token lists included); document buffer: "
          f"{buffer_bytes / max(1, crop[-1][4]):.2f} bytes per buffered token ({dtype}) + "
          f"~{per_doc_overhead} bytes per document")


def _cuda() -> bool:
    try:  # torch is optional here: the benchmark runs on CPU without it
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    run(main, "bench_dataloader stopped; it only measures, on data in temporary directories: "
              "rerun it")

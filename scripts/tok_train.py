"""
Train the BPE tokenizer on the train shards and save it (tokenizer.json + token_bytes.npy).

    python -m scripts.tok_train --max-chars 2000000000 --vocab-size 65536

The default 2B characters is ~8 shards of ClimbMix (~250M characters each) and trains in a few
minutes on a multi-core node; rustbpe's time grows roughly linearly with characters.
"""

import argparse
import math
import os
import time

from tqdm.contrib.logging import logging_redirect_tqdm

from nanochat.data.base.cli import run
from nanochat.common import get_base_dir
from nanochat.data.base.datasets import find_data_dir, open_parquet, split_parquet_files
from nanochat.dataset import parquets_iter_batched
from nanochat.data.base.files import progress_bar
from nanochat.tokenizer import MIN_VOCAB_SIZE, RustBPETokenizer

SAMPLES = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "In 2024, 12345 people paid $67.89 each.",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé: 你好世界, привет мир, 🙂",
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m scripts.tok_train",
                                     description="Train a BPE tokenizer on the train shards")
    # the underscore spellings are upstream nanochat's, kept so its recipes still run
    parser.add_argument("--max-chars", "--max_chars", type=int, default=2_000_000_000,
                        help="stop after this many characters of text (default: 2B)")
    parser.add_argument("--doc-cap", "--doc_cap", type=int, default=10_000,
                        help="crop each document to this many characters (default: 10000)")
    parser.add_argument("--vocab-size", "--vocab_size", type=int, default=65536,
                        help="vocab size including the special tokens (default: 65536 = 2^16)")
    parser.add_argument("--data-dir", default=None,
                        help="parquet shards (default: the dataset's directory)")
    parser.add_argument("--out-dir", default=None,
                        help="where to save (default: <base_dir>/tokenizer)")
    args = parser.parse_args(argv)
    if args.max_chars < 1:
        parser.error(f"--max-chars must be >= 1, got {args.max_chars}")
    if args.doc_cap < 1:
        parser.error(f"--doc-cap must be >= 1, got {args.doc_cap}")
    if args.vocab_size < MIN_VOCAB_SIZE:  # said here, before minutes of reading shards
        parser.error(f"--vocab-size must be >= {MIN_VOCAB_SIZE} (256 bytes + the special tokens), "
                     f"got {args.vocab_size}")
    return args


def main(argv=None):
    args = parse_args(argv)
    data_dir = find_data_dir() if args.data_dir is None else args.data_dir
    out_dir = os.path.join(get_base_dir(), "tokenizer") if args.out_dir is None else args.out_dir
    print(f"max_chars: {args.max_chars:,}")
    print(f"doc_cap: {args.doc_cap:,}")
    print(f"vocab_size: {args.vocab_size:,}")
    print(f"data_dir: {data_dir}")
    print(f"out_dir: {out_dir}")

    counts = {"chars": 0, "docs": 0}

    def text_iterator():
        """Train documents, each cropped to doc_cap, until max_chars characters in all. The bar
        counts row groups against those in the train shards, and against fewer once the characters
        seen so far say that max_chars will end the run first."""
        # footers only: counting the row groups of 8 shards reads no text
        row_groups = sum(open_parquet(path).num_row_groups
                         for path in split_parquet_files("train", data_dir))
        # a bar on a terminal, a line per quarter in a log file
        with progress_bar(total=row_groups, unit="row group", desc="reading") as progress:
            for texts in parquets_iter_batched("train", data_dir=data_dir):
                for text in texts:
                    # the last document is cut so the total is max_chars exactly
                    text = text[:min(args.doc_cap, args.max_chars - counts["chars"])]
                    counts["chars"] += len(text)
                    counts["docs"] += 1
                    yield text
                    if counts["chars"] >= args.max_chars:
                        progress.total = progress.n + 1  # the bar ends full at this row group
                        break
                progress.update(1)
                progress.set_postfix(chars=f"{counts['chars']:,}")
                if counts["chars"] >= args.max_chars:
                    return
                # row groups read so far, scaled by the characters still to come
                expected = (math.ceil(args.max_chars * progress.n / counts["chars"])
                            if counts["chars"] else row_groups)
                progress.total = min(row_groups, max(expected, progress.n + 1))

    try:  # no shards, or a file where their directory belongs: the message says what to do
        split_parquet_files("train", data_dir)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    t0 = time.time()
    tokenizer = RustBPETokenizer.train_from_iterator(text_iterator(), args.vocab_size)
    train_time = time.time() - t0
    if counts["chars"] == 0:
        raise SystemExit(f"error: the train shards in {data_dir} hold no text; nothing to train on")
    tokenizer.save(out_dir)

    # sanity check: every sample survives a round trip
    for text in SAMPLES:
        assert tokenizer.decode(tokenizer.encode(text)) == text, f"round trip failed for {text!r}"

    print(f"trained on {counts['chars']:,} characters from {counts['docs']:,} documents in "
          f"{train_time:.2f}s")
    print(f"vocab size: {tokenizer.get_vocab_size():,} (bos id {tokenizer.get_bos_token_id()})")
    for text in SAMPLES:
        ids = tokenizer.encode(text)
        # each token as a string, or as bytes where it holds part of a UTF-8 character
        pieces = [_readable(tokenizer.decode_single_token_bytes(i)) for i in ids]
        print(f"{text!r}: {len(text.encode('utf-8'))} bytes -> {len(ids)} tokens:")
        print("  " + " ".join(map(repr, pieces)))
    print(f"saved tokenizer to {out_dir}")


def _readable(piece: bytes) -> str | bytes:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return piece


def _main() -> None:
    with logging_redirect_tqdm():  # a warning while the bar is drawn goes above it, not through it
        main()


if __name__ == "__main__":
    run(_main, "tok_train stopped; it saves the tokenizer whole at the end, or not at all: "
               "rerun it (it trains from the start)")

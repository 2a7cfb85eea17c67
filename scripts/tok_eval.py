"""
Compression of the tokenizer (UTF-8 bytes per token, higher is better) on a sample of the train and
val shards: the first row group(s) of each split, up to --max-docs documents.

    python -m scripts.tok_eval --max-docs 1000

For reference, GPT-2's and GPT-4's (cl100k_base) tokenizers are measured on the same documents when
tiktoken can load them (it downloads them once into its cache; offline they are skipped). Expect
~4.8 bytes/token on FineWeb-Edu for a 65536 vocab trained on 2B characters.
"""

import argparse

from nanochat.data.base.cli import run
from nanochat.data.base.datasets import find_data_dir
from nanochat.dataset import parquets_iter_batched
from nanochat.tokenizer import RustBPETokenizer, get_tokenizer_dir


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m scripts.tok_eval",
        description="Bytes per token of the tokenizer on train and val shards")
    parser.add_argument("--tokenizer-dir", default=None, help="default: <base_dir>/tokenizer")
    parser.add_argument("--data-dir", default=None,
                        help="parquet shards (default: the dataset's directory)")
    parser.add_argument("--max-docs", type=int, default=1000,
                        help="documents per split (default: 1000)")
    parser.add_argument("--compare", default="gpt2,cl100k_base",
                        help="comma-separated tiktoken encodings to compare with, or 'none' "
                             "(default: gpt2,cl100k_base)")
    args = parser.parse_args(argv)
    if args.max_docs < 1:
        parser.error(f"--max-docs must be >= 1, got {args.max_docs}")
    return args


def sample_docs(split: str, max_docs: int, data_dir: str) -> list[str]:
    """The first max_docs documents of a split, read row group by row group."""
    docs = []
    for texts in parquets_iter_batched(split, data_dir=data_dir):
        docs.extend(texts[:max_docs - len(docs)])  # the last row group only as far as needed
        if len(docs) >= max_docs:
            break
    return docs


def load_references(names: list[str]) -> dict:
    """tiktoken's named encodings that can be loaded; the others are reported and skipped."""
    references = {}
    for name in names:
        try:
            references[name] = RustBPETokenizer.from_pretrained(name)
        except (OSError, ValueError) as e:  # OSError covers requests' connection errors
            # 120 characters: a connection error's message can run to several lines
            print(f"skipping {name}: not available ({type(e).__name__}: {str(e)[:120]})")
    return references


def main(argv=None):
    args = parse_args(argv)
    tokenizer_dir = get_tokenizer_dir() if args.tokenizer_dir is None else args.tokenizer_dir
    data_dir = find_data_dir() if args.data_dir is None else args.data_dir
    names = ([] if args.compare.strip().lower() in ("", "none")
             else [n.strip() for n in args.compare.split(",") if n.strip()])
    print(f"tokenizer_dir: {tokenizer_dir}")
    print(f"data_dir: {data_dir}")
    print(f"max_docs: {args.max_docs}")
    print(f"compare: {names}")

    try:
        tokenizers = {"ours": RustBPETokenizer.from_directory(tokenizer_dir)}
        split_docs = {split: sample_docs(split, args.max_docs, data_dir)
                      for split in ("train", "val")}
    # no tokenizer or no shards, or a file or another kind of data where the shards should be: the
    # message says what to do
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    tokenizers.update(load_references(names))

    print(f"{'split':<6} {'tokenizer':<12} {'vocab':>8} {'docs':>6} {'bytes':>12} {'tokens':>10} "
          f"{'bytes/token':>11} {'vs ours':>8}")
    for split, docs in split_docs.items():
        n_bytes = sum(len(doc.encode("utf-8")) for doc in docs)
        ours_tokens = None
        for name, tokenizer in tokenizers.items():
            n_tokens = sum(len(ids) for ids in tokenizer.encode(docs))
            ours_tokens = n_tokens if ours_tokens is None else ours_tokens  # "ours" comes first
            ratio = n_bytes / n_tokens if n_tokens else float("nan")
            # positive: this tokenizer needs more tokens than ours for the same text
            diff = f"{100 * (n_tokens - ours_tokens) / ours_tokens:+.1f}%" if ours_tokens else "n/a"
            print(f"{split:<6} {name:<12} {tokenizer.get_vocab_size():>8} {len(docs):>6} "
                  f"{n_bytes:>12,} {n_tokens:>10,} {ratio:>11.3f} {diff:>8}")


if __name__ == "__main__":
    run(main, "tok_eval stopped; it only reads: rerun it")

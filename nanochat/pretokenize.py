"""
`python -m nanochat.pretokenize`: tokenize parquet or jsonl once, into `.bin`/`.idx` pairs.
Training then memory-maps tokens and neither decodes parquet nor tokenizes. Long documents may be
cut into overlapping windows, under nanochat's convention ([BOS] + document) or GPT-Simple's
(document + EOD). A job is units of work (whole inputs, and parts of local inputs larger than
--unit-mb), run on this machine's processes, shared among ranks (--rank/--world-size, or torchrun's
or Slurm's variables), or as tasks on a Ray cluster (--executor ray). Other engines drive the same
two calls on pretokenize_job(...)'s job: units.plan_units(job), then units.tokenize_unit(job, unit).

    python -m nanochat.pretokenize --input DATA_DIR --output DATA_DIR_tokens --num-workers 8

--input may also be a store's address (s3://bucket/prefix, gs://, az://, hf://). Cost: one
tokenizer pass, several MB of text per second per core; a rerun skips written pairs.
The run: nanochat/data/processing/. Design: docs/pretokenized.md, docs/streaming.md (stores).

May import: nanochat.common, nanochat.data, nanochat.tokenizer.
"""

import argparse
import functools
import logging
import math
import os

from nanochat.data.fetch import stores
from nanochat.data.fetch.errors import MissingExtra
from nanochat.data.base.checks import rank_cpus
from nanochat.data.base.cli import run
from nanochat.common import get_dist_info
from nanochat.data.processing.inputs import UNIT_MB, local_input
from nanochat.data.processing.pretokenize_run import EXECUTORS, PretokenizeRun, run_pretokenize
from nanochat.data.processing.ray_executor import import_ray
from nanochat.data.processing.slurm import slurm_share
from nanochat.data.processing.units import PretokenizeJob
from nanochat.data.pretokenized.token_shards import CONVENTIONS
from nanochat.data.processing.windows import check_window_args
from nanochat.tokenizer import TOKENIZER_FILENAME, RustBPETokenizer, get_tokenizer_dir

LOCK_TIMEOUT = 10.0  # seconds a run waits for another run on its output to finish (--lock-timeout)



def main(argv: list[str] | None = None) -> int:
    """`python -m nanochat.pretokenize --input DIR --output DIR [...]`. Returns 0, or 1 when a
    unit failed (the others are still written). Bad arguments exit through argparse; missing or
    unusable inputs, tokenizer or output settings raise FileNotFoundError / ValueError up front."""
    args, rank, world_size = _parse(argv)
    tokenizer_dir = args.tokenizer_dir or get_tokenizer_dir()
    print(f"input={args.input} val_input={args.val_input} output={args.output} "
          f"bucket={args.bucket} tokenizer_dir={tokenizer_dir} text_field={args.text_field} "
          f"max_length={args.max_length} overlap_size={args.overlap_size} "
          f"num_workers={args.num_workers} rank={rank} world_size={world_size} "
          f"convention={args.convention} unit_mb={args.unit_mb:g} executor={args.executor}")
    job = pretokenize_job(args.input, args.output, tokenizer_dir=tokenizer_dir,
                          val_inputs=args.val_input, bucket=args.bucket,
                          text_field=args.text_field, max_length=args.max_length,
                          overlap_size=args.overlap_size, convention=args.convention,
                          unit_mb=args.unit_mb, absolute=args.executor == "ray")
    return run_pretokenize(PretokenizeRun(
        job=job, num_workers=args.num_workers, rank=rank, world_size=world_size,
        lock_timeout=args.lock_timeout, executor=args.executor, ray_address=args.ray_address))


def pretokenize_job(inputs: list[str], output: str, *, tokenizer_dir: str | None = None,
                    val_inputs: list[str] | None = None, bucket: str | None = None,
                    text_field: str = "text", max_length: int | None = None,
                    overlap_size: int = 0, convention: str = "nanochat",
                    unit_mb: float | None = UNIT_MB, absolute: bool = False) -> PretokenizeJob:
    """The job the command runs, for plan_units and tokenize_unit: the same arguments as its flags
    (tokenizer_dir: default <base dir>/tokenizer; unit_mb None: never split an input), checked
    (ValueError). Each process that tokenizes loads the tokenizer from tokenizer_dir once.
    absolute: make the paths absolute, for workers that run in other directories (Ray's)."""
    if max_length is not None:
        check_window_args(max_length, overlap_size)
    elif overlap_size:
        raise ValueError(f"overlap_size {overlap_size} needs max_length (windowing is off without "
                         "it)")
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {list(CONVENTIONS)}, got {convention!r}")
    if unit_mb is not None and not 0 < unit_mb < math.inf:  # written so that NaN fails too
        raise ValueError(f"unit_mb must be a number of MB > 0 (None: never split), got {unit_mb}")
    # "~" works in every path, also where no shell expanded it (--output=~/x, a subprocess's
    # argument list)
    tokenizer_dir = local_input(tokenizer_dir or get_tokenizer_dir(), absolute)
    return PretokenizeJob(
        inputs=[local_input(p, absolute) for p in inputs], output=local_input(output, absolute),
        # each process loads its own tokenizer (a tokenizer does not pickle; this does)
        load_tokenizer=functools.partial(RustBPETokenizer.from_directory, tokenizer_dir),
        tokenizer_file=os.path.join(tokenizer_dir, TOKENIZER_FILENAME),
        val_inputs=None if val_inputs is None else [local_input(p, absolute) for p in val_inputs],
        bucket=bucket, text_field=text_field, max_length=max_length,
        overlap=overlap_size if max_length is not None else 0, convention=convention,
        unit_bytes=None if unit_mb is None else max(1, int(unit_mb * 2**20)))


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, int, int]:
    """The arguments checked (pretokenize_job expands their paths), and this process's rank and
    world size."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.max_length is not None:
        try:
            check_window_args(args.max_length, args.overlap_size)
        except ValueError as e:
            parser.error(f"--max-length {args.max_length} / --overlap-size "
                         f"{args.overlap_size}: {e}")
    elif args.overlap_size:
        parser.error(f"--overlap-size {args.overlap_size} needs --max-length (windowing is off "
                     "without it)")
    if args.num_workers < 1:
        parser.error(f"--num-workers must be >= 1, got {args.num_workers}")
    if not args.lock_timeout >= 0:  # written so that NaN fails too
        parser.error(f"--lock-timeout must be >= 0 seconds, got {args.lock_timeout}")
    if args.bucket is not None and (args.bucket in ("", ".", "..") or "/" in args.bucket
                                    or os.sep in args.bucket):
        parser.error(f"--bucket must be a directory name (no '/'), got {args.bucket!r}")
    if not 0 < args.unit_mb < math.inf:
        parser.error(f"--unit-mb must be a number of MB > 0, got {args.unit_mb}")
    if args.ray_address is not None and args.executor != "ray":
        parser.error(f"--ray-address {args.ray_address} needs --executor ray (without it the "
                     "job runs on this machine's processes)")
    rank, world_size = _share(args, parser)
    if world_size < 1 or not 0 <= rank < world_size:
        parser.error(f"need 0 <= --rank < --world-size, got rank {rank}, world size {world_size}")
    if args.executor == "ray" and world_size > 1:
        parser.error(f"--executor ray runs the whole job as one Ray job, but this process is rank "
                     f"{rank} of {world_size}: start it once, without --rank/--world-size, "
                     "torchrun or srun's tasks")
    if args.executor == "ray":
        import_ray()  # a missing extra is one line now, not after the inputs are listed
    return args, rank, world_size


def _share(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[int, int]:
    """This process's rank and world size, each from its flag, else torchrun's RANK/WORLD_SIZE,
    else Slurm's tasks and array (slurm.py), else 0 of 1."""
    is_ddp, env_rank, _, env_world_size = get_dist_info()
    if not is_ddp:
        try:
            share = slurm_share(os.environ)
        except ValueError as e:
            parser.error(str(e))
        if share is not None:
            print(f"Slurm: {share.what}")
        env_rank, env_world_size = (0, 1) if share is None else share[:2]
    return (env_rank if args.rank is None else args.rank,
            env_world_size if args.world_size is None else args.world_size)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nanochat.pretokenize",
        description="Tokenize parquet shards or jsonl files into .bin/.idx token shards, one pair "
                    "per input, under OUTPUT/train and OUTPUT/val. Rerun to resume: complete pairs "
                    "are skipped.")
    parser.add_argument("--input", nargs="+", required=True,
                        help="a parquet dataset directory or a store's address "
                             "(s3://bucket/prefix, gs://, az://, hf://datasets/owner/name/folder, "
                             "file://; last shard = val), or .jsonl/.jsonl.gz files or directories "
                             "of them (all train)")
    parser.add_argument("--val-input", nargs="+", default=None,
                        help="jsonl files or directories for val/")
    parser.add_argument("--output", required=True,
                        help="output directory (train/ and val/ go under it)")
    parser.add_argument("--bucket", default=None,
                        help="write a mixture bucket: OUTPUT/train/BUCKET/ and OUTPUT/val/BUCKET/ "
                             "(default: none, OUTPUT/train/ and OUTPUT/val/)")
    parser.add_argument("--tokenizer-dir", default=None, help="default: <base dir>/tokenizer")
    parser.add_argument("--text-field", default="text", help="the jsonl field holding the text")
    parser.add_argument("--max-length", type=int, default=None,
                        help="cut documents into windows of at most this many tokens, BOS included "
                             "(default: no windowing)")
    parser.add_argument("--overlap-size", type=int, default=0,
                        help="document tokens each window repeats from the previous one "
                             "(<= max_length // 2)")
    parser.add_argument("--convention", choices=CONVENTIONS, default="nanochat",
                        help="nanochat: an entry is BOS + the document (default); gpt-simple: the "
                             "document + EOD, no BOS, as GPT-Simple's loader expects (EOD = the "
                             "tokenizer's <|bos|> id)")
    parser.add_argument("--num-workers", type=int, default=min(8, max(1, rank_cpus())),
                        help="processes tokenizing units in parallel (1: this process; default: "
                             "the CPUs this process may use, up to 8)")
    parser.add_argument("--rank", type=int, default=None,
                        help="this process's share: units rank, rank + world_size, ... "
                             "(default: $RANK, else Slurm's task and array index, else 0)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="default: $WORLD_SIZE, else Slurm's tasks times array tasks, else 1")
    parser.add_argument("--unit-mb", type=float, default=UNIT_MB,
                        help="split a local input larger than this into units of about this many "
                             "MB (parquet row groups, jsonl lines), tokenized in parallel and "
                             "written as NAME.part-K-of-N pairs; a store's shard stays whole "
                             f"(default {UNIT_MB})")
    parser.add_argument("--executor", choices=EXECUTORS, default="local",
                        help="local: this machine's --num-workers processes (default); ray: "
                             "every unit as a task on a Ray cluster (pip install "
                             "'nanochat-data[ray]')")
    parser.add_argument("--ray-address", default=None,
                        help="the Ray cluster's address (default: $RAY_ADDRESS, else a new "
                             "cluster on this machine)")
    parser.add_argument("--lock-timeout", type=float, default=LOCK_TIMEOUT,
                        help="seconds to wait for another run on the same --output (and rank) to "
                             f"finish before giving up (default {LOCK_TIMEOUT:g})")
    return parser


INTERRUPTED = ("pretokenize stopped; the pairs it wrote are complete and no partial one is left: "
               "rerun the same command to write the rest (it skips the pairs done)")


def command() -> None:
    """`python -m nanochat.pretokenize`: main() with its log on stderr, a bad input and Ctrl-C
    in one line each (nanochat.data.base.cli.run)."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stores.quiet_clients()
    # FileNotFoundError and a store's error are OSErrors; a store's missing package is one line too
    run(main, INTERRUPTED, (ValueError, OSError, MissingExtra))


if __name__ == "__main__":
    command()

"""
nanochat's dataset.py: its API over the shard store in nanochat/data/, and the shard command.
list_parquet_files, parquets_iter_batched and download_single_file, as nanochat has them. A dataset
is a numbered run of parquet shards (`shard_00000.parquet`, ...) with one `text` column in row
groups of ~1024 documents; its last shard is val, the others train.

    python -m nanochat.dataset -n 240 -w 4     # fetch and verify ~100MB shards (download.py)
    python -m nanochat.dataset -n 8 --base-url s3://bucket/prefix --data-dir DIR   # from a store
    python -m nanochat.dataset --verify        # check the shards on disk, offline
    python -m nanochat.dataset repackage a.jsonl b.txt --out DIR   # your own text (repackage.py)
    python -m nanochat.dataset serve DIR --port 8000   # serve shards to stream (serve.py)

Cost: a row group is one pyarrow read, a few ms for ~1024 documents. Design: docs/downloads.md

May import: nanochat.data.base, nanochat.data.fetch, nanochat.data.loader.
"""

import argparse
import logging
import os
import sys

from tqdm.contrib.logging import logging_redirect_tqdm

from nanochat.data.base.checks import check_int
from nanochat.data.base.cli import run
from nanochat.data.base.datasets import (DATASETS, DEFAULT_DATASET, DatasetSpec, dataset_of,
                                         get_base_url, get_data_dir, get_dataset, get_shards_hint,
                                         hosted, index_to_filename, list_parquet_files,
                                         open_parquet, read_row_group_texts, shard_index,
                                         split_parquet_files)
from nanochat.data.fetch import stores
from nanochat.data.fetch.address import check_address, check_source, is_http, join, shown
from nanochat.data.fetch.errors import DownloadError, MissingExtra
from nanochat.data.fetch.download import Report, download_file, download_files, summarize
from nanochat.data.fetch.limits import (BACKOFF_BASE, DEADLINE, MAX_ATTEMPTS, MIN_RATE, RATE_WINDOW,
                                        REQUEST_TIMEOUT, Limits)
from nanochat.data.fetch.records import record_path, stated_check
from nanochat.data.fetch.sources import SOURCE_FIX, check_sources
from nanochat.data.fetch.verify import check_files
from nanochat.data.fetch.listing import check_own, listing_source, read_listing
from nanochat.data.fetch.repackage import main as repackage_main
from nanochat.data.fetch.serve import main as serve_main

logger = logging.getLogger(__name__)

# -----------------------------------------------------------------------------
# Reading: nanochat's iterator over a split's row groups


def parquets_iter_batched(split: str, start: int = 0, step: int = 1, data_dir: str | None = None):
    """Yield the texts of row groups start, start+step, ... of each file of the split, in order.
    start/step shard across ranks (start=rank, step=world_size)."""
    check_int("start", start, 0)
    check_int("step", step, 1)
    for path in split_parquet_files(split, data_dir):
        pf = open_parquet(path)
        for rg_idx in range(start, pf.num_row_groups, step):
            yield read_row_group_texts(pf, rg_idx, path)


# -----------------------------------------------------------------------------
# Downloading: which shards, their names and addresses (the machinery is in download.py)


def shard_url(index: int, base_url: str) -> str:
    return join(base_url, index_to_filename(index))


def download_single_file(index: int, data_dir: str | None = None, base_url: str | None = None,
                         max_attempts: int = MAX_ATTEMPTS, backoff_base: float = BACKOFF_BASE, *,
                         dataset: str | None = None, timeout: float = REQUEST_TIMEOUT,
                         progress: bool | None = None, min_rate: float = MIN_RATE,
                         rate_window: float = RATE_WINDOW, deadline: float = DEADLINE) -> bool:
    """Fetch shard `index` into data_dir unless a sound copy is there; True when one is there
    afterwards. A copy that fails its checks is fetched again. Safe to call from several threads or
    processes at once. Raises HostNotFoundError when the host does not resolve (no retry can help).
    progress: bytes bar per shard (None: only on a terminal); timeout, min_rate (bytes/s over
    rate_window seconds) and deadline (seconds for the shard) bound the time spent: see
    nanochat/data/fetch/download.py."""
    check_int("shard index", index, 0)
    limits = Limits(max_attempts, backoff_base, timeout, min_rate, rate_window, deadline)
    data_dir = (get_data_dir(dataset) if data_dir is None
                else os.path.expanduser(os.fspath(data_dir)))
    base_url = get_base_url(dataset) if base_url is None else base_url
    check_source(base_url, data_dir)
    url, path = shard_url(index, base_url), os.path.join(data_dir, index_to_filename(index))
    check_sources([(url, path)], SOURCE_FIX, limits)  # (the directory: one source's shards)
    try:
        download_file(url, path, limits, progress=progress)
    except DownloadError as e:  # nanochat's signature: False, not an exception
        logger.error("%s", e)
        return False
    return True


def _fetch_shards(indices: list[int], data_dir: str, base_url: str, num_workers: int,
                  limits: Limits, *, progress: bool | None, check_disk: bool) -> Report:
    """What fetching these shards did: the CLI prints it, download_shards returns its failures."""
    # before the per-shard addresses, so that the error names what the user passed
    check_source(base_url, data_dir)
    files = [(shard_url(i, base_url), os.path.join(data_dir, index_to_filename(i)))
             for i in indices]
    return download_files(files, num_workers, limits, progress=progress, check_disk=check_disk)


def download_shards(indices, data_dir: str | None = None, base_url: str | None = None,
                    num_workers: int = 4, max_attempts: int = MAX_ATTEMPTS,
                    backoff_base: float = BACKOFF_BASE, *, dataset: str | None = None,
                    timeout: float = REQUEST_TIMEOUT, progress: bool | None = None,
                    check_disk: bool = True, min_rate: float = MIN_RATE,
                    rate_window: float = RATE_WINDOW, deadline: float = DEADLINE) -> list[int]:
    """Fetch the given shard indices with num_workers threads (0: in this thread); shards already
    there are checked and fetched again when bad. Returns the sorted indices that failed; empty
    means every shard is now on disk and verified. Raises ValueError before any download when
    base_url is not an address (check_address), OSError when check_disk finds the missing shards
    won't fit, and HostNotFoundError as soon as the host does not resolve (the whole run stops:
    no retry can help)."""
    limits = Limits(max_attempts, backoff_base, timeout, min_rate, rate_window, deadline)
    indices = sorted(set(indices))  # a repeated index would fetch one file twice, in two threads
    data_dir = (get_data_dir(dataset) if data_dir is None
                else os.path.expanduser(os.fspath(data_dir)))
    base_url = get_base_url(dataset) if base_url is None else base_url
    report = _fetch_shards(indices, data_dir, base_url, num_workers, limits, progress=progress,
                           check_disk=check_disk)
    return [i for i in indices if index_to_filename(i) in report.failed]


# -----------------------------------------------------------------------------
# Command line

DOWNLOAD_HELP = ("Download pretraining shards (plus, always, the validation shard); shards already "
                 "there are checked and fetched again when bad. To convert your own text instead: "
                 "python -m nanochat.dataset repackage --help; to serve shards to a streaming "
                 "loader: python -m nanochat.dataset serve --help")


def _download_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nanochat.dataset", description=DOWNLOAD_HELP)
    parser.add_argument("-n", "--num-files", type=int, default=-1,
                        help="train shards to fetch, from shard 0 (default: -1, every shard; 0: "
                             "only val). From a store's address (s3://..., a directory): the "
                             "first N train names it lists in sorted order (its last name is "
                             "val, always fetched)")
    parser.add_argument("-w", "--num-workers", type=int, default=4,
                        help="parallel downloads or checks (default: 4; 0: one at a time)")
    parser.add_argument("--dataset", default=None,
                        help=f"one of {sorted(DATASETS)} (default: $NANOCHAT_DATASET, "
                             f"else {DEFAULT_DATASET})")
    parser.add_argument("--base-url", default=None,
                        help="where the shards are: an https:// URL, s3://bucket/prefix, "
                             "gs://bucket/prefix, az://container/prefix, hf://datasets/owner/"
                             "name/folder, file:///path or a local directory (default: "
                             "$NANOCHAT_DATA_URL, else the dataset's URL). A store's shards keep "
                             "the names it lists; with --verify, names the source in the fix")
    parser.add_argument("--data-dir", default=None, help="default: <base dir>/<dataset subdir>")
    parser.add_argument("--verify", action="store_true",
                        help="download nothing: check every shard in the data dir (size and "
                             "sha256 against its .json record, PAR1 magic, parquet metadata, and "
                             "every page unless the record vouches for them) and exit 1 if any "
                             "is bad")
    parser.add_argument("--max-attempts", type=int, default=MAX_ATTEMPTS,
                        help="attempts in a row without progress, per shard (default: "
                             f"{MAX_ATTEMPTS})")
    parser.add_argument("--backoff-base", type=float, default=BACKOFF_BASE,
                        help="seconds before the 2nd attempt; doubles after each failure "
                             f"(default: {BACKOFF_BASE:g})")
    parser.add_argument("--timeout", type=float, default=REQUEST_TIMEOUT,
                        help="seconds of silence before an attempt fails (default: "
                             f"{REQUEST_TIMEOUT:g})")
    parser.add_argument("--min-rate", type=float, default=MIN_RATE / 1e3,
                        help="KB/s: an attempt slower than this over --rate-window fails "
                             f"(default: {MIN_RATE / 1e3:g})")
    parser.add_argument("--rate-window", type=float, default=RATE_WINDOW,
                        help=f"seconds the rate is averaged over (default: {RATE_WINDOW:g})")
    parser.add_argument("--deadline", type=float, default=DEADLINE,
                        help="seconds for one shard, all attempts together (default: "
                             f"{DEADLINE:g})")
    return parser


def _download_main(argv: list[str]) -> int:
    parser = _download_parser()
    args = parser.parse_args(argv)
    # each bad value is named before anything is fetched; argparse has made them numbers already
    if args.num_files < -1:
        parser.error(f"-n/--num-files must be >= -1 (-1 means all shards), got {args.num_files}")
    if args.num_workers < 0:
        parser.error(f"-w/--num-workers must be >= 0, got {args.num_workers}")
    if args.max_attempts < 1:
        parser.error(f"--max-attempts must be >= 1, got {args.max_attempts}")
    for flag, value in (("--backoff-base", args.backoff_base), ("--min-rate", args.min_rate)):
        if value < 0:
            parser.error(f"{flag} must be >= 0, got {value:g}")
    for flag, value in (("--timeout", args.timeout), ("--rate-window", args.rate_window),
                        ("--deadline", args.deadline)):
        if value <= 0:
            parser.error(f"{flag} must be > 0 seconds, got {value:g}")

    spec = get_dataset(args.dataset)
    data_dir = os.path.expanduser(args.data_dir) if args.data_dir else get_data_dir(spec.name)
    if args.verify:
        source = args.base_url or get_base_url(spec.name)
        check_address(source)  # a mistyped address says so, rather than a fix for another
        return _verify_main(spec, data_dir, args.num_workers, source)
    base_url = args.base_url or get_base_url(spec.name)
    check_source(base_url, data_dir)
    limits = Limits(args.max_attempts, args.backoff_base, args.timeout, args.min_rate * 1e3,
                    args.rate_window, args.deadline)  # --min-rate is in KB/s, Limits in bytes/s
    bounds = (f"max_attempts={args.max_attempts} backoff_base={args.backoff_base:g}s "
              f"timeout={args.timeout:g}s min_rate={args.min_rate:g}KB/s "
              f"rate_window={args.rate_window:g}s deadline={args.deadline:g}s")
    listing, label, listed = _listing_to_fetch(spec, base_url, data_dir, limits)
    train = listing[:-1]
    asked = len(train) if args.num_files == -1 else args.num_files
    names = train[:asked] + listing[-1:]  # val always: every loader needs it
    print(f"{'' if listed else 'dataset=' + spec.name + ' '}"
          f"train_shards={len(names) - 1} val_shard={names[-1]} workers={args.num_workers} "
          f"data_dir={data_dir} base_url={shown(base_url)} {bounds}")
    short = asked > len(train)  # a shortfall: fetch what there is, then say so and exit 1
    if short:
        print(f"-n {asked} asks for more train shards than the {len(train)} {label}: fetching "
              f"those {len(train)} and val, then exiting 1")
    files = [(join(base_url, name), os.path.join(data_dir, name)) for name in names]
    report = download_files(files, args.num_workers, limits, progress=None, check_disk=True)
    got = len(names) - len(report.failed)
    if short:  # never N/N for fewer than were asked for
        print(f"downloaded {got} of the {asked + 1} shards asked for ({asked} train and val) to "
              f"{data_dir}: {label} only {len(train)} train shards")
    else:
        print(f"downloaded {got}/{len(names)} shards to {data_dir}")
    fetched = [os.path.join(data_dir, n) for n in names if n not in report.failed]
    if fetched:
        print(_checked_words(fetched, base_url))
    _print_problems(report)
    return 1 if report.failed or short else 0


def _listing_to_fetch(spec: DatasetSpec, base_url: str, data_dir: str,
                      limits: Limits) -> tuple[list[str], str, bool]:
    """(the names the download picks from, train first and val last; who names them, for
    messages; whether a listing named them). A server's index.json (python -m nanochat.dataset
    serve makes one) or a store's listing names them, as it does for a streaming loader; a server
    with none (the Hugging Face hub) has the dataset's names."""
    # (the hub has no listing: not asked, so that a rerun with every shard there needs no network)
    listing = None if hosted(base_url) else read_listing(base_url, limits)
    if listing is None:
        train = [index_to_filename(i) for i in range(spec.max_shard)]  # val: the last index
        return train + [spec.val_filename], f"{spec.name} has", False
    check_own(listing, data_dir, listing_source(base_url))
    return listing, f"{listing_source(base_url)} lists", True


def _print_problems(report: Report) -> None:
    """The shards replaced and those that failed, and a rerun's advice only where it can help."""
    if report.replaced:
        print(f"replaced {len(report.replaced)} bad shards that were there:")
        print("\n".join(summarize(report.replaced)))
    if not report.failed:
        return
    retry = len(report.failed) - len(report.final)
    if not retry:
        advice = "a rerun cannot help: check the source and the names it has"
    else:
        which = f" the {retry} that may succeed" if report.final else ""
        advice = f"rerun the same command to retry{which} (partial downloads resume)"
    print(f"failed ({len(report.failed)}); {advice}:")
    print("\n".join(summarize(report.failed)))


def _checked_words(paths: list[str], base_url: str) -> str:
    """How the files fetched were checked: against a hash the server or store stated (verified),
    or only their size and parquet structure (it stated none)."""
    stated = sum(stated_check(path) is not None for path in paths)
    words = [f"{stated} verified against the hash {shown(base_url)} stated"] if stated else []
    if stated < len(paths):
        words.append(f"{len(paths) - stated} size and structure checked ({shown(base_url)} "
                     "stated no hash for them: their size, parquet structure and every page "
                     "were checked)")
    return "; ".join(words)


def _verify_main(spec: DatasetSpec, data_dir: str, num_workers: int, base_url: str) -> int:
    """--verify: check every shard in data_dir, offline; 1 when any is bad, with the command that
    fixes it (from base_url when it is a store's address)."""
    paths = list_parquet_files(data_dir)
    if not paths:
        raise FileNotFoundError(f"no parquet shards in {data_dir}; {get_shards_hint(data_dir)}")
    bad = check_files(paths, num_workers)
    unrecorded = sum(not os.path.exists(record_path(p)) for p in paths)
    print(f"checked {len(paths)} shards in {data_dir}: {len(paths) - len(bad)} good, "
          f"{len(bad)} bad")
    if unrecorded:
        print(f"{unrecorded} have no .json record (your own shards, or fetched by another tool): "
              "for them the parquet structure and every page were checked, not size and sha256")
    if not bad:
        return 0
    print("\n".join(summarize({os.path.basename(p): e.reason for p, e in bad.items()})))
    for path, error in list(bad.items())[:3]:  # the full messages of a few, for the log
        logger.info("%s", error)
    if not is_http(base_url):
        return _store_fix(paths, data_dir, base_url)
    # only a shard of the dataset is fetched again: named like its shards, and either in its own
    # directory (nanochat's downloader writes no .json record) or with our downloader's record.
    # Any other is your own, and a download would write the dataset into your data
    ours = dataset_of(data_dir) == spec
    fetched = {os.path.basename(p): shard_index(os.path.basename(p), spec) for p in paths
               if ours or os.path.exists(record_path(p))}
    fetched = {name: i for name, i in fetched.items() if i is not None}
    if any(os.path.basename(p) in fetched for p in bad):
        # -n covers every fetched train shard on disk, so the rerun re-checks them all and fetches
        # the bad ones again
        num_files = 1 + max((i for i in fetched.values() if i < spec.max_shard), default=-1)
        print(f"to fix: python -m nanochat.dataset --dataset {spec.name} --data-dir {data_dir} "
              f"-n {num_files} (add your --base-url if you used one); it fetches the bad shards "
              "again")
    others = sorted(os.path.basename(p) for p in bad if os.path.basename(p) not in fetched)
    if others:
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        print(f"not fetchable from {spec.name} (named unlike its shards, or outside its "
              "directory with no .json record), so nothing here downloads them: "
              f"{', '.join(others[:3])}{more}; write them again from their source files "
              "(python -m nanochat.dataset repackage INPUTS --out NEW_DIR, a directory without "
              "parquet files) or delete them")
    return 1


def _store_fix(paths: list[str], data_dir: str, base_url: str) -> int:
    """--verify's fix for shards from a store: the download again, which re-checks every shard it
    names and fetches the bad ones. The files there are, in sorted order, the first train names
    the store lists and its val, as the download left them; -n counts the train ones."""
    print(f"to fix: python -m nanochat.dataset --base-url {shown(base_url)} --data-dir "
          f"{data_dir} -n {len(paths) - 1}; it fetches the bad shards again from there (a file "
          "it does not list stays bad: write it again from its source, or delete it)")
    return 1


def main(argv: list[str] | None = None) -> int:
    """`python -m nanochat.dataset [-n N -w W ...]` downloads, `... --verify` checks the local
    shards, `... repackage INPUTS --out DIR` converts, `... serve DIR` serves. Returns the exit
    status (1 when a shard failed or is bad); bad input raises ValueError/FileNotFoundError/OSError
    (HostNotFoundError when the host does not resolve)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["repackage"]:  # a subcommand by hand: the download takes no positional
        return repackage_main(argv[1:])
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    return _download_main(argv)


def interrupted(argv: list[str]) -> str:
    """What Ctrl-C on `python -m nanochat.dataset ARGS` stopped, what it left and what a rerun
    does (nanochat.data.base.cli.run prints it)."""
    if argv[:1] == ["repackage"]:
        return ("repackage stopped; the shards it had written are removed (a part of them would "
                "split train and val wrongly), the input files are untouched: rerun the same "
                "command")
    if argv[:1] == ["serve"]:
        return "serve stopped; it changed nothing: rerun the same command to serve again"
    if any(arg.startswith("--v") for arg in argv):  # --verify, or argparse's abbreviation of it
        return "--verify stopped; it changes nothing: rerun it to check every shard"
    return ("the download stopped; the shards it installed are complete, partial ones stay as "
            ".tmp files: rerun the same command to resume them")


def _main() -> int:
    with logging_redirect_tqdm():  # log lines go above the progress bars, not through them
        return main()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stores.quiet_clients()
    # FileNotFoundError is an OSError: one line, no traceback
    run(_main, interrupted, (ValueError, OSError, MissingExtra))

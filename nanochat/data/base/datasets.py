"""
The parquet datasets: which we know, where their shards live, their split, reading their text.
ClimbMix-400B (nanochat's) and FineWeb-Edu-100B (its earlier one): their hub repos, shard names and
counts, the directory the readers use when given none. A dataset is a numbered run of parquet
shards (`shard_00000.parquet`, ...); val is the last file in sorted order, train the others. An
empty or missing directory, or one of another kind, is an error that says what it holds and how to
fill it; a shard that does not read names the file, the row group and the fix.

Cost: a directory listing or two; opening a shard reads its footer; a row group is one pyarrow
call, a few ms for ~1024 documents.

May import: pyarrow, nanochat.common, nanochat.data.base.layout.
"""

import logging
import os
import re
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from nanochat.common import get_base_dir
from nanochat.data.base.layout import INPUT_SUFFIXES, check_kind

logger = logging.getLogger(__name__)


# -----------------------------------------------------------------------------
# The datasets we know and where the readers find one


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    repo: str  # Hugging Face dataset repo that hosts the shards
    max_shard: int  # index of the last shard, which is the validation shard
    subdir: str  # directory under the base dir

    @property
    def base_url(self) -> str:
        # resolve/main: the file's bytes at the main branch, not its web page
        return f"https://huggingface.co/datasets/{self.repo}/resolve/main"

    @property
    def val_filename(self) -> str:
        return index_to_filename(self.max_shard)


DATASETS = {
    # nanochat's dataset since March 2026: 6543 shards of ~100MB (zstd), ~250M characters each
    "climbmix-400b": DatasetSpec("climbmix-400b", "karpathy/climbmix-400b-shuffle", 6542,
                                 "base_data_climbmix"),
    # nanochat's earlier dataset: ~100B GPT-2 tokens of FineWeb-Edu, shuffled; 1823 shards of
    # ~100MB (zstd)
    "fineweb-edu-100b": DatasetSpec("fineweb-edu-100b", "karpathy/fineweb-edu-100b-shuffle", 1822,
                                    "base_data"),
}
DEFAULT_DATASET = "climbmix-400b"  # what nanochat itself downloads and reads


def index_to_filename(index: int) -> str:
    return f"shard_{index:05d}.parquet"  # 5 digits: sorted names are index order


def get_dataset(name: str | None = None) -> DatasetSpec:
    """The dataset named by `name`, else $NANOCHAT_DATASET, else ClimbMix-400B (what the downloader
    fetches)."""
    name = name or os.environ.get("NANOCHAT_DATASET") or DEFAULT_DATASET  # "" counts as unset
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r} (from --dataset or NANOCHAT_DATASET); "
                         f"choose one of {sorted(DATASETS)}")
    return DATASETS[name]


def get_data_dir(dataset: str | None = None) -> str:
    """Where the shards of a dataset live: <base_dir>/base_data_climbmix for the default dataset."""
    return os.path.join(get_base_dir(), get_dataset(dataset).subdir)


def find_dataset() -> DatasetSpec:
    """The dataset the readers use when given no data_dir: $NANOCHAT_DATASET when set; else the one
    whose directory holds train shards (the downloader's names are nanochat's); when several do, the
    default one (logged once); when none does, the default one."""
    if os.environ.get("NANOCHAT_DATASET"):
        return get_dataset()
    # a directory with no train shard (a failed first download, `-n 0`) hides nothing
    present = [spec for spec in DATASETS.values()
               if _has_train_shards(get_data_dir(spec.name), spec)]
    if len(present) == 1:
        return present[0]
    if len(present) > 1:
        log_once(logger, logging.WARNING,
                 "found %s; reading %s, the default (set NANOCHAT_DATASET to choose)",
                 " and ".join(get_data_dir(spec.name) for spec in present),
                 get_data_dir(DEFAULT_DATASET))
    return get_dataset(DEFAULT_DATASET)


def _has_train_shards(data_dir: str, spec: DatasetSpec) -> bool:
    return os.path.isdir(data_dir) and any(name.endswith(".parquet")
                                           and name != spec.val_filename
                                           for name in os.listdir(data_dir))


def find_data_dir() -> str:
    """The directory the readers use when given no data_dir: $NANOCHAT_DATA_DIR when set (your own
    shards, or the cache they stream into, for scripts that pass no data_dir, such as nanochat's),
    else the found dataset's (see find_dataset)."""
    if os.environ.get("NANOCHAT_DATA_DIR"):  # "" counts as unset
        return os.path.expanduser(os.environ["NANOCHAT_DATA_DIR"])
    return get_data_dir(find_dataset().name)


# -----------------------------------------------------------------------------
# A dataset's directory, its shards' names and its source


def dataset_of(data_dir: str) -> DatasetSpec | None:
    """The known dataset whose directory this is (by its name, e.g. base_data_climbmix), or
    None."""
    name = os.path.basename(os.path.normpath(data_dir))  # normpath: "dir/" names "dir" too
    return next((spec for spec in DATASETS.values() if spec.subdir == name), None)


def shard_index(name: str, spec: DatasetSpec) -> int | None:
    """The index of a shard of spec named like the downloader names it, else None."""
    match = re.fullmatch(r"shard_(\d{5})\.parquet", name)
    return int(match.group(1)) if match and int(match.group(1)) <= spec.max_shard else None


def get_base_url(dataset: str | None = None) -> str:
    """Where shards are fetched from: $NANOCHAT_DATA_URL, else the dataset's Hugging Face repo."""
    return os.environ.get("NANOCHAT_DATA_URL") or get_dataset(dataset).base_url


def hosted(base_url: str) -> bool:
    """Whether base_url is a dataset's own (the Hugging Face hub's repository), not a mirror."""
    return base_url.rstrip("/") in {spec.base_url.rstrip("/") for spec in DATASETS.values()}


# -----------------------------------------------------------------------------
# The splits, and warnings said once

SPLITS = ("train", "val")  # val is the last shard in sorted order, train the others


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")


_LOGGED: set = set()  # (message, args) already logged by log_once, whichever the logger


def log_once(log: logging.Logger, level: int, message: str, *args) -> None:
    """Log a message once per process: the loaders list the shards for every split and every
    rank."""
    if (message, args) not in _LOGGED:
        _LOGGED.add((message, args))
        log.log(level, message, *args)


# -----------------------------------------------------------------------------
# A directory's parquet shards, and nanochat's split of them

def list_parquet_files(data_dir: str | None = None) -> list[str]:
    """Sorted full paths of the `*.parquet` files in data_dir (default: find_data_dir()).
    Partial downloads live under other names (`*.parquet.tmp`, ...) and are never listed. A
    directory of pretokenized shards or buckets, or a file, is a ValueError that says so (an empty
    directory lists nothing)."""
    data_dir = find_data_dir() if data_dir is None else os.path.expanduser(os.fspath(data_dir))
    if not os.path.isdir(data_dir):
        check_kind(data_dir, "parquet")  # a file (a shard, most often): a ValueError that says so
        raise FileNotFoundError(f"data directory {data_dir} does not exist; "
                                f"{get_shards_hint(data_dir)}")
    names = sorted(f for f in os.listdir(data_dir) if f.endswith(".parquet"))
    if not names:  # no parquet: say what the directory holds instead, if anything
        check_kind(data_dir, "parquet")
    return [os.path.join(data_dir, f) for f in names]


def split_parquet_files(split: str, data_dir: str | None = None) -> list[str]:
    """The files of one split: val is the last file in sorted order, train the others (nanochat's
    rule). In a dataset's directory that is its last index, e.g. shard_06542.parquet, however many
    train shards were fetched; if it is not (your own shards there), one warning says which file is
    val and how to fetch the dataset's. Raises when the split would be empty."""
    check_split(split)
    data_dir = find_data_dir() if data_dir is None else os.path.expanduser(os.fspath(data_dir))
    paths = list_parquet_files(data_dir)
    if not paths:
        raise FileNotFoundError(f"no parquet shards in {data_dir}; {get_shards_hint(data_dir)}")
    val_path = paths[-1]  # nanochat's rule, whatever the names: the loaders agree on val
    spec = dataset_of(data_dir)
    if spec and os.path.basename(val_path) != spec.val_filename:
        if os.path.join(data_dir, spec.val_filename) in paths:
            why = "sorts before it, so it is a train shard here"
        else:
            why = f"is missing (to fetch it: python -m nanochat.dataset --dataset {spec.name} -n 0)"
        log_once(logger, logging.WARNING,
                 "%s: the last file in sorted order, %s, is val; %s's validation shard %s %s",
                 data_dir, os.path.basename(val_path), spec.name, spec.val_filename, why)
    if split == "val":
        return [val_path]
    train = [p for p in paths if p != val_path]
    if not train:
        raise FileNotFoundError(
            f"{data_dir} holds only the validation shard {os.path.basename(val_path)}, so the "
            "train split is empty; download train shards: python -m nanochat.dataset -n 8")
    return train


def get_shards_hint(data_dir: str) -> str:
    """How to fill an empty or missing data_dir: the dataset's shards, or shards of your own; and
    for the directory the readers found by themselves, how it was found."""
    return (f"download some: python -m nanochat.dataset -n 8, or write your own text files "
            f"({', '.join(INPUT_SUFFIXES)}) as shards: python -m nanochat.dataset repackage "
            f"INPUTS --out {data_dir}{_found_words(data_dir)}")


def _found_words(data_dir: str) -> str:
    """Where the directory the readers use when given no data_dir came from, and how to choose
    another; "" for any other directory (one passed by hand)."""
    own = os.environ.get("NANOCHAT_DATA_DIR")  # "" counts as unset
    if own:
        if os.path.abspath(os.path.expanduser(own)) != os.path.abspath(data_dir):
            return ""
        return (". It is $NANOCHAT_DATA_DIR, which the readers use when given no data_dir: "
                "point it at the directory of your shards, or unset it")
    spec = dataset_of(data_dir)
    if spec is None or (os.path.abspath(os.path.dirname(os.path.normpath(data_dir)))
                        != os.path.abspath(get_base_dir())):
        return ""
    origin = ("from NANOCHAT_BASE_DIR" if os.environ.get("NANOCHAT_BASE_DIR")
             else "~/.cache/nanochat, as NANOCHAT_BASE_DIR is unset")
    return (f". Given no data_dir, the readers use <base_dir>/{spec.subdir}, with <base_dir> "
            f"{origin}; to read shards elsewhere, pass data_dir (--data-dir), or export "
            "NANOCHAT_DATA_DIR=DIR (the shards' directory) or NANOCHAT_BASE_DIR=DIR (DIR holds "
            f"{spec.subdir}/)")


# -----------------------------------------------------------------------------
# Reading a shard's text

def open_parquet(path: str) -> pq.ParquetFile:
    """Open a shard, reading its footer; a 0-byte, truncated or non-parquet file is a ValueError
    that names it and the fix, not pyarrow's message without the file name."""
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, FileNotFoundError):  # removed since it was listed: say so, not "corrupt"
            raise FileNotFoundError(f"shard {path} does not exist (it was there when the shards "
                                    "were listed)") from None
        raise ValueError(f"{path} is not a readable parquet file ({e}); "
                         f"{verify_hint(path)}") from None


def read_row_group_texts(pf: pq.ParquetFile, rg_idx: int, path: str) -> list[str]:
    """The `text` column of one row group as a list of str, or a clear error naming file and row
    group."""
    return read_row_group_column(pf, rg_idx, path).to_pylist()


def read_row_group_column(pf: pq.ParquetFile, rg_idx: int, path: str) -> pa.ChunkedArray:
    """The checked `text` column of one row group, still in Arrow memory. Turning it into Python
    strings holds the GIL throughout (~5 ms for 1024 FineWeb documents), so a loader converts it a
    slice at a time and lets its tokenizer threads in between."""
    if "text" not in pf.schema_arrow.names:
        raise ValueError(f"{path} has no 'text' column (columns: {pf.schema_arrow.names}); "
                         "shards need one string column named 'text'")
    try:
        column = pf.read_row_group(rg_idx, columns=["text"]).column("text")
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path} row group {rg_idx} could not be read ({e}); "
                         f"{verify_hint(path)}") from None
    # large_string: what pyarrow writes for columns over 2 GB, the same text to us
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ValueError(f"{path} row group {rg_idx}: column 'text' has type {column.type}, "
                         "expected string")
    if column.null_count:  # a None would reach the tokenizer and fail there, far from the file
        raise ValueError(f"{path} row group {rg_idx}: column 'text' has {column.null_count} null "
                         "values")
    return column


def verify_hint(path: str) -> str:
    """The fix for a shard that cannot be read: find every bad one, then fetch them again (the
    downloader reads every page of a shard that no sha256 from the server vouches for)."""
    return (f"python -m nanochat.dataset --verify --data-dir {os.path.dirname(path) or '.'} lists "
            "every bad shard and the command that fetches them again (a streaming loader fetches "
            "its bad shards again when it restarts)")

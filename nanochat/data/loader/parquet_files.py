"""
The parquet shards of a directory, and nanochat's split of them.
The parquet shards of a directory, and nanochat's split of them: val is the last file in sorted
order, train the others. An empty or missing directory, or one of another kind (pretokenized
shards, mixture buckets), is an error that says what it holds and how to fill it.

Cost: one directory listing.

May import: nanochat.common, nanochat.data.base.datasets, nanochat.data.fetch.repackage,
nanochat.data.pretokenized.layout.
"""

import logging
import os

from nanochat.common import get_base_dir
from nanochat.data.base.datasets import check_split, dataset_of, find_data_dir, log_once
from nanochat.data.fetch.repackage import INPUT_SUFFIXES
from nanochat.data.pretokenized.layout import check_kind

logger = logging.getLogger(__name__)


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

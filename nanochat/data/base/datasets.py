"""
The datasets we know, where their shards live, and the two splits.
The datasets we know (ClimbMix-400B, nanochat's; FineWeb-Edu-100B, its earlier one): their hub
repos, shard names and counts, the directory the readers use when given none, and the two splits.
A dataset is a numbered run of parquet shards (`shard_00000.parquet`, ...); its last is val.

Cost: names and environment variables; finding the dataset lists a directory or two.

May import: nanochat.common.
"""

import logging
import os
import re
from dataclasses import dataclass

from nanochat.common import get_base_dir

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

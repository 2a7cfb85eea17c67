"""
The pretraining shard store: which dataset, where its parquet shards live, and reading them.

A dataset is a numbered run of parquet shards (`shard_00000.parquet`, ...) with one `text` column,
row groups of ~1024 documents. The last index of a dataset is its validation shard; everything
else is train. Reading one row group costs one pyarrow call (a few ms for ~1024 documents).
"""

import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from nanochat.common import get_base_dir

# -----------------------------------------------------------------------------
# The datasets we know how to fetch


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    repo: str  # Hugging Face dataset repo that hosts the shards
    max_shard: int  # index of the last shard, which is the validation shard
    subdir: str  # directory under the base dir

    @property
    def base_url(self) -> str:
        return f"https://huggingface.co/datasets/{self.repo}/resolve/main"

    @property
    def val_filename(self) -> str:
        return index_to_filename(self.max_shard)


DATASETS = {
    # ~100B GPT-2 tokens of FineWeb-Edu, shuffled; 1823 shards of ~100MB (zstd)
    "fineweb-edu-100b": DatasetSpec("fineweb-edu-100b", "karpathy/fineweb-edu-100b-shuffle", 1822, "base_data"),
    # nanochat's newer, larger set
    "climbmix-400b": DatasetSpec("climbmix-400b", "karpathy/climbmix-400b-shuffle", 6542, "base_data_climbmix"),
}
DEFAULT_DATASET = "fineweb-edu-100b"


def index_to_filename(index: int) -> str:
    return f"shard_{index:05d}.parquet"


def get_dataset(name: str | None = None) -> DatasetSpec:
    """The dataset named by `name`, else $NANOCHAT_DATASET, else FineWeb-Edu-100B."""
    name = name or os.environ.get("NANOCHAT_DATASET") or DEFAULT_DATASET
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r} (from --dataset or NANOCHAT_DATASET); "
                         f"choose one of {sorted(DATASETS)}")
    return DATASETS[name]


def get_data_dir(dataset: str | None = None) -> str:
    """Where the shards of a dataset live: <base_dir>/base_data for the default dataset."""
    return os.path.join(get_base_dir(), get_dataset(dataset).subdir)


# -----------------------------------------------------------------------------
# Listing and splitting

SPLITS = ("train", "val")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")


def list_parquet_files(data_dir: str | None = None) -> list[str]:
    """Sorted full paths of the `*.parquet` files in data_dir (default: the dataset's directory).
    Partial downloads live under other names (`*.parquet.tmp`, ...) and are never listed."""
    data_dir = get_data_dir() if data_dir is None else data_dir
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(
            f"data directory {data_dir} does not exist; download some shards first: "
            "python -m nanochat.dataset -n 8")
    names = sorted(f for f in os.listdir(data_dir) if f.endswith(".parquet"))
    return [os.path.join(data_dir, f) for f in names]


def split_parquet_files(split: str, data_dir: str | None = None) -> list[str]:
    """The files of one split. The validation shard is pinned by name when the directory holds a
    known dataset's last shard (so fetching more or fewer train shards never changes "val");
    otherwise the last file in sorted order is val. Raises when the split would be empty."""
    _check_split(split)
    shown_dir = get_data_dir() if data_dir is None else data_dir
    paths = list_parquet_files(data_dir)
    if not paths:
        raise FileNotFoundError(
            f"no parquet shards in {shown_dir}; download some first: python -m nanochat.dataset -n 8")
    val_names = {spec.val_filename for spec in DATASETS.values()}
    pinned = [p for p in paths if os.path.basename(p) in val_names]
    if data_dir is None and not pinned:
        raise FileNotFoundError(
            f"the validation shard {get_dataset().val_filename} is missing from {shown_dir}; "
            "fetch it with: python -m nanochat.dataset -n 0")
    val_path = pinned[-1] if pinned else paths[-1]
    if split == "val":
        return [val_path]
    train = [p for p in paths if p != val_path]
    if not train:
        raise FileNotFoundError(
            f"{shown_dir} holds only the validation shard {os.path.basename(val_path)}, so the train split "
            "is empty; download train shards: python -m nanochat.dataset -n 8")
    return train


# -----------------------------------------------------------------------------
# Reading


def read_row_group_texts(pf: pq.ParquetFile, rg_idx: int, path: str) -> list[str]:
    """The `text` column of one row group as a list of str, or a clear error naming file and row group."""
    if "text" not in pf.schema_arrow.names:
        raise ValueError(f"{path} has no 'text' column (columns: {pf.schema_arrow.names}); "
                         "shards need one string column named 'text'")
    column = pf.read_row_group(rg_idx, columns=["text"]).column("text")
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ValueError(f"{path} row group {rg_idx}: column 'text' has type {column.type}, expected string")
    if column.null_count:
        raise ValueError(f"{path} row group {rg_idx}: column 'text' has {column.null_count} null values")
    return column.to_pylist()


def parquets_iter_batched(split: str, start: int = 0, step: int = 1, data_dir: str | None = None):
    """Yield the texts of row groups start, start+step, ... of each file of the split, in order.
    start/step shard across ranks (start=rank, step=world_size)."""
    if start < 0 or step < 1:
        raise ValueError(f"need start >= 0 and step >= 1, got start={start}, step={step}")
    for path in split_parquet_files(split, data_dir):
        pf = pq.ParquetFile(path)
        for rg_idx in range(start, pf.num_row_groups, step):
            yield read_row_group_texts(pf, rg_idx, path)

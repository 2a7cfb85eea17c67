"""
The shards of a streaming loader's split, on disk or not yet.
The split a streaming loader (stream=True) reads, whether its files are on disk or not: by the
source's listing when it has one (val its last name, as on disk), else by the dataset's names
(val its last index). Each name comes with its path in data_dir and its address at the source.

Cost: names and a stat or two; the listing itself is read by the caller (fetch.listing).

May import: nanochat.data.base.checks, nanochat.data.base.datasets, nanochat.data.fetch.address,
nanochat.data.fetch.listing, nanochat.data.fetch.stores.
"""

import os
from typing import NamedTuple

from nanochat.data.base.checks import check_int
from nanochat.data.base.datasets import (DatasetSpec, check_split, dataset_of, find_data_dir,
                                         find_dataset, get_base_url, index_to_filename)
from nanochat.data.fetch.address import check_source, join
from nanochat.data.fetch.listing import check_own, listing_source


class SplitShards(NamedTuple):
    data_dir: str  # where the shards are (or will be) on disk
    paths: list[str]  # each shard's path in data_dir
    urls: list[str]  # each shard's address at the source
    val_name: str  # the val shard's name


def streamed_split(split: str, data_dir: str | None = None, num_shards: int | None = None,
                   base_url: str | None = None,
                   listing: list[str] | None = None) -> SplitShards:
    """A split of shards read while they stream in (a loader's stream=True), whether the files are
    on disk or not. With a listing (read_listing's names), the rule on disk: val is the last name,
    train the first num_shards others (default: all), the names kept as they are. Without one, the
    dataset's names: val is its last index, train its first num_shards; the dataset is the one
    data_dir is the directory of, else find_dataset()'s."""
    check_split(split)
    data_dir, spec, base_url = _stream_source(data_dir, base_url)
    if listing is None:
        names = [index_to_filename(i) for i in range(spec.max_shard + 1)]
        shards_hint = f" (the train shards of {spec.name})"
    else:
        names, shards_hint = listing, f" (the train shards {listing_source(base_url)} lists)"
        check_own(listing, data_dir, listing_source(base_url))
    if num_shards is None:
        num_shards = len(names) - 1  # every train shard
    check_int("num_shards (or NANOCHAT_STREAM_SHARDS)", num_shards, 1, len(names) - 1,
              hint=shards_hint)
    # val is the last name even when few train shards are streamed
    chosen = names[-1:] if split == "val" else names[:num_shards]
    return SplitShards(data_dir, [os.path.join(data_dir, name) for name in chosen],
                       [join(base_url, name) for name in chosen], names[-1])


def _stream_source(data_dir, base_url) -> tuple[str, DatasetSpec, str]:
    """(data_dir, the dataset, base_url) of a streamed split, the defaults filled in."""
    data_dir = find_data_dir() if data_dir is None else os.path.expanduser(os.fspath(data_dir))
    spec = dataset_of(data_dir) or find_dataset()
    base_url = get_base_url(spec.name) if base_url is None else base_url
    check_source(base_url, data_dir)
    return data_dir, spec, base_url


def stream_source(data_dir: str | None, base_url: str | None) -> tuple[str, str]:
    """(data_dir, base_url) of a streamed split: the defaults filled in, the address checked."""
    data_dir, _, base_url = _stream_source(data_dir, base_url)
    return data_dir, base_url

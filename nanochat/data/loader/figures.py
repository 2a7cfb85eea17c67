"""
A loader's figures for a training log, and the one short line that prints them.
They count what it did since the last figures() call and in total: next()'s wait, tokens per second
in and out, crop and masked shares, documents per row, and for a streaming loader its downloads,
evictions and cache use. DataLoader.figures() (nanochat/data/loader/build.py) takes a Mark after
each call and subtracts. The counts come from the packers' running totals that every state carries,
so nothing new crosses from a worker process. Design: docs/loaders.md#figures.

May import: the standard library.
"""

from typing import NamedTuple


class Figures(NamedTuple):
    """What a loader did over one stretch of time: since the last figures() call, or in total."""
    seconds: float  # wall time of the stretch
    batches: int  # batches yielded
    wait_seconds: float  # time next() waited for a batch: the stall the trainer felt
    wait_share: float  # wait_seconds / seconds
    tokens_tokenized: int  # document tokens that entered the buffer (tokenized, or read)
    tokens_emitted: int  # input tokens yielded: B * T per batch
    tokenized_per_second: float
    emitted_per_second: float
    crop_share: float  # tokens cropped / (cropped + document tokens placed in rows)
    # targets yielded as -100 / B * T per batch: the repeated overlap in front of a piece or a
    # window. No row is padded, so this is 0 unless split_overlap or windows overlap.
    masked_share: float
    docs_per_row: float | None  # documents and pieces per row; None: the concatenating loader
    bytes_downloaded: int | None  # streaming: what this loader fetched; None: not streaming
    evictions: int | None  # streaming: shards this loader evicted to stay within cache_limit

    @property
    def pad_share(self) -> float:
        """masked_share under its other name: the targets yielded as -100 (nothing is padded)."""
        return self.masked_share


class LoaderFigures(NamedTuple):
    """loader.figures(): since the last call and in total, and a streaming loader's cache now.
    str() (or .line()) is one short line for a log."""
    since_last: Figures  # since the last figures() call (the first: since the loader was made)
    total: Figures  # since the loader was made (after a resume: from the resume)
    cache_bytes: int | None  # streaming: what cache_limit bounds, on disk now; None: not streaming
    cache_limit: int | None

    def line(self) -> str:
        """`loader: wait 0.3% | 1.21M tok/s in, 0.98M out | crop 18.5% masked 0.0% |
        2.1 docs/row | cache 1.2/2.0 GB, 3.4 GB down, 5 evicted`: the rates and shares since the
        last call, the cache's downloads and evictions in total. masked: targets yielded as -100
        (repeated overlaps), never padding: rows are always full."""
        f = self.since_last
        parts = [f"loader: wait {f.wait_share:.1%}",
                 f"{_count_words(f.tokenized_per_second)} tok/s in, "
                 f"{_count_words(f.emitted_per_second)} out",
                 f"crop {f.crop_share:.1%} masked {f.masked_share:.1%}"]
        if f.docs_per_row is not None:
            parts.append(f"{f.docs_per_row:.1f} docs/row")
        if self.cache_bytes is not None:
            used = (_size_words(self.cache_bytes) if self.cache_limit is None
                    else _size_words(self.cache_bytes, self.cache_limit))
            parts.append(f"cache {used}, {_size_words(self.total.bytes_downloaded)} down, "
                         f"{self.total.evictions} evicted")
        return " | ".join(parts)

    def __str__(self) -> str:
        return self.line()


def _count_words(n: float) -> str:
    """1.21M, 987k, 12.3k, 950: three digits at most (999,999 is 1.00M, not 1000k)."""
    for unit, scale in (("", 1), ("k", 1e3), ("M", 1e6), ("G", 1e9)):
        v = n / scale
        text = f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"
        if float(text) < 1000 or unit == "G":
            return text + unit


def _size_words(*sizes: int) -> str:
    """Sizes in the unit of the largest, one decimal: '1.2/2.0 GB', '3.4 GB', '512 bytes'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if max(sizes) >= scale:
            return "/".join(f"{n / scale:.1f}" for n in sizes) + f" {unit}"
    return "/".join(str(n) for n in sizes) + " bytes"


class Mark(NamedTuple):
    """Where a loader stood at one moment: what figures() subtracts."""
    time: float  # time.perf_counter()
    wait_seconds: float
    batches: int
    counters: dict  # the packers' running totals (nanochat.data.base.packing's COUNTERS)
    fetched_bytes: int | None  # streaming: downloaded so far; None: not streaming
    evictions: int | None


def stretch(then: Mark, now: Mark, BT: int) -> Figures:
    """The figures of the stretch from `then` to `now` (B * T input tokens a batch)."""
    seconds = now.time - then.time
    count = {name: value - then.counters.get(name, 0) for name, value in now.counters.items()}
    batches = now.batches - then.batches
    wait = now.wait_seconds - then.wait_seconds
    emitted = batches * BT
    cropped = count.get("tokens_cropped", 0)
    # the BOS and overlap in front of a piece are placed, but are no document's tokens
    placed = (count.get("tokens_out", 0) - count.get("tokens_bos_added", 0)
              - count.get("tokens_repeated", 0))

    def rate(n: float) -> float:
        return n / seconds if seconds > 0 else 0.0

    streaming = now.fetched_bytes is not None
    return Figures(
        seconds=seconds, batches=batches, wait_seconds=wait, wait_share=rate(wait),
        tokens_tokenized=count.get("tokens_in", 0), tokens_emitted=emitted,
        tokenized_per_second=rate(count.get("tokens_in", 0)), emitted_per_second=rate(emitted),
        crop_share=cropped / max(1, placed + cropped),  # (as the packer's crop_share)
        masked_share=count.get("tokens_masked", 0) / max(1, emitted),
        # (the concatenating packer counts no rows: its rows cut through documents)
        docs_per_row=count["docs_placed"] / max(1, count["rows"]) if "rows" in count else None,
        bytes_downloaded=now.fetched_bytes - (then.fetched_bytes or 0) if streaming else None,
        evictions=now.evictions - (then.evictions or 0) if streaming else None)

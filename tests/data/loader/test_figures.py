"""
A loader's figures (DataLoader.figures(), docs/loaders.md#figures): tokens in and out, crop and
masked shares (its line says "masked", never "pad": rows are never padded) and documents per row,
since the last call and in total, checked exactly against the loader's stats and against the batches
themselves; for the best-fit, concatenating, pretokenized and mixture loaders, on threads, in a
worker process, after a resume, and streaming from a real HTTP server on 127.0.0.1 (bytes
downloaded, evictions, the cache against cache_limit). Run: python -m pytest
tests/data/loader/test_figures.py -q   (about 15 s; the worker's test starts one)
"""

import os
import random
import re
import time

import numpy as np
import pytest

from conftest import ByteTokenizer, write_shard, write_shards
from nanochat.dataloader import (pretokenized_distributed_data_loader_with_state_bos_bestfit,
                                 tokenizing_distributed_data_loader_with_state,
                                 tokenizing_distributed_data_loader_with_state_bos_bestfit)
from nanochat.data.base.datasets import index_to_filename
from nanochat.data.fetch.limits import Limits
from nanochat.data.loader.figures import Figures, LoaderFigures, Mark, stretch
from nanochat.mixture import pretokenized_mixture_loader_with_state_bos_bestfit
from nanochat.data.fetch.serve import ShardServer
from nanochat.data.pretokenized.token_shards import write_token_shard

BOS = ByteTokenizer.bos
B, T = 4, 32
BESTFIT = tokenizing_distributed_data_loader_with_state_bos_bestfit


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """3 parquet shards of documents of 1-120 characters (B*T = 128: many are cropped), and
    pretokenized shards of two buckets, BOS first, no BOS inside."""
    root = tmp_path_factory.mktemp("figures")
    rng = random.Random(0)
    write_shards(root / "parquet", [["".join(rng.choice("abc ") for _ in range(rng.randint(1, 120)))
                                     for _ in range(150)] for _ in range(3)], row_group_size=25)
    np_rng = np.random.default_rng(0)
    # two mixture buckets, and the long one again as a pretokenize output
    for name, mean in (("long", 60), ("short", 10)):
        lengths = np.maximum(1, np_rng.geometric(1 / mean, size=400))
        entries = [np.concatenate(([BOS], np_rng.integers(0, 256, k - 1))).astype(np.uint16)
                   for k in lengths]
        for directory in [root / "mixture" / "train" / name] + (
                [root / "pretokenized" / "train"] if name == "long" else []):
            os.makedirs(directory)
            write_token_shard(str(directory / "shard_000"), entries, [0] * len(entries), np.uint16)
    return root


def parquet_loader(corpus, function=BESTFIT, **kwargs):
    kwargs = dict(device="cpu", data_dir=str(corpus / "parquet"), tokenizer_batch_size=8,
                  workers=0) | kwargs
    return function(ByteTokenizer(), B, T, "train", **kwargs)


def run(loader, n: int) -> dict:
    """n batches: the documents and pieces each row holds (a BOS leads each, and one may start at
    the last target alone) and the targets set to -100."""
    docs, masked = [], 0
    for _ in range(n):
        inputs, targets = next(loader)[:2]
        docs += ((inputs == BOS).sum(dim=1) + (targets[:, -1] == BOS)).tolist()
        masked += int((targets == -100).sum())
    return {"docs": docs, "masked": masked}


def check_sums(first: LoaderFigures, second: LoaderFigures) -> None:
    """The counts of two calls add up to the total of the second."""
    for name in ("batches", "tokens_tokenized", "tokens_emitted"):
        assert (getattr(first.since_last, name) + getattr(second.since_last, name)
                == getattr(second.total, name)), name
    assert first.since_last == first.total  # (the first call: since the loader was made)


@pytest.mark.parametrize("policy, overlap", [("crop", 0), ("split", 4)])
def test_best_fit_figures_add_up_and_match_the_batches(corpus, policy, overlap):
    loader = parquet_loader(corpus, buffer_size=16, long_doc_policy=policy, split_overlap=overlap)
    before = loader.figures()
    assert (before.total.batches, before.total.tokens_emitted,
            before.total.masked_share) == (0, 0, 0)
    seen = [run(loader, 3), run(loader, 5)]
    first = loader.figures()  # (after 8 batches)
    seen.append(run(loader, 4))
    second, again = loader.figures(), loader.figures()
    stats = loader.stats
    loader.close()
    # the first call covers the 8 batches since `before`; the second the 4 since the first
    assert (first.since_last.batches, second.since_last.batches, second.total.batches) == (8, 4, 12)
    assert second.since_last.tokens_emitted == 4 * B * T
    assert second.total.tokens_emitted == 12 * B * T
    assert (first.since_last.tokens_tokenized + second.since_last.tokens_tokenized
            == second.total.tokens_tokenized == stats["tokens_tokenized"])
    # in total, as the packer's stats; since the last call, as the batches show
    assert second.total.crop_share == stats["crop_share"]
    assert second.total.docs_per_row == stats["docs_per_row_mean"]
    assert second.total.docs_per_row == sum(d for x in seen for d in x["docs"]) / (12 * B)
    assert second.since_last.docs_per_row == sum(seen[2]["docs"]) / (4 * B)
    assert first.since_last.docs_per_row == sum(seen[0]["docs"] + seen[1]["docs"]) / (8 * B)
    assert second.total.wait_seconds == stats["wait_seconds"]
    if policy == "crop":  # cropping, and no target masked
        assert stats["tokens_cropped"] > 0 and second.total.crop_share > 0
        assert second.total.masked_share == second.since_last.masked_share == 0.0
    else:  # split pieces repeat 4 tokens, whose targets are -100
        assert second.total.masked_share == sum(x["masked"] for x in seen) / (12 * B * T) > 0
        assert second.since_last.masked_share == seen[2]["masked"] / (4 * B * T)
    # a call right after another: nothing happened in between
    assert (again.since_last.batches, again.since_last.tokens_tokenized,
            again.since_last.tokens_emitted, again.since_last.crop_share,
            again.since_last.masked_share) == (0, 0, 0, 0.0, 0.0)
    assert again.total._replace(seconds=0, wait_share=0, tokenized_per_second=0,
                                emitted_per_second=0) == second.total._replace(
        seconds=0, wait_share=0, tokenized_per_second=0, emitted_per_second=0)
    # one short line, rounded, of the figures since the last call
    f = second.since_last
    line = str(second)
    assert line == second.line() and line.startswith(f"loader: wait {f.wait_share:.1%} | ")
    shares = (f"| crop {f.crop_share:.1%} masked {f.masked_share:.1%} "
              f"| {f.docs_per_row:.1f} docs/row")
    assert shares in line
    assert re.fullmatch(r"loader: wait \d+\.\d% \| [\d.]+[kMG]? tok/s in, [\d.]+[kMG]? out \| "
                        r"crop \d+\.\d% masked \d+\.\d% \| \d+\.\d docs/row", line), line
    assert "cache" not in line and (f.bytes_downloaded, f.evictions) == (None, None)
    assert (second.cache_bytes, second.cache_limit) == (None, None)


def test_concatenated_rows_have_no_documents_per_row(corpus):
    loader = parquet_loader(corpus, function=tokenizing_distributed_data_loader_with_state)
    run(loader, 3)
    figures = loader.figures()
    stats = loader.stats
    loader.close()
    assert figures.total.tokens_emitted == 3 * B * T == stats["tokens_emitted"]
    assert figures.total.tokens_tokenized == stats["tokens_tokenized"]
    assert (figures.total.crop_share, figures.total.masked_share) == (0.0, 0.0)
    assert figures.total.docs_per_row is None and "docs/row" not in figures.line()


def test_after_a_resume_the_figures_count_from_the_resume(corpus):
    loader = parquet_loader(corpus, buffer_size=16)
    run(loader, 5)
    state = next(loader)[2]
    start = state["counters"]
    loader.close()
    resumed = parquet_loader(corpus, buffer_size=16, resume_state_dict=state)
    run(resumed, 4)
    figures, stats = resumed.figures(), resumed.stats
    resumed.close()
    # stats go on from the run's counters; the figures count this loader's batches only
    assert stats["tokens_tokenized"] > figures.total.tokens_tokenized > 0
    assert figures.total.tokens_tokenized == stats["tokens_tokenized"] - start["tokens_in"]
    assert figures.total.tokens_emitted == 4 * B * T
    out = stats["tokens_emitted"] - start["tokens_out"]  # (no pieces: every token a document's)
    cropped = stats["tokens_cropped"] - start["tokens_cropped"]
    assert figures.total.crop_share == cropped / (out + cropped)


@pytest.mark.slow
def test_figures_from_a_worker_process(corpus):
    """The batches' figures come with them through the worker's pipe; the resumed state's counters
    with its start."""
    threads = parquet_loader(corpus, buffer_size=16, long_doc_policy="split", split_overlap=4)
    state = [next(threads) for _ in range(3)][-1][2]
    threads.close()
    loader = parquet_loader(corpus, buffer_size=16, long_doc_policy="split", split_overlap=4,
                            resume_state_dict=state, workers=1)
    assert loader.worker_pid is not None
    first = loader.figures()
    seen = run(loader, 6)
    second = loader.figures()
    stats = loader.stats
    loader.close()
    after = loader.figures()  # (closed: the counts stand)
    check_sums(first, second)
    total = second.total
    assert (total.batches, total.tokens_emitted) == (6, 6 * B * T)
    assert total.tokens_tokenized == stats["tokens_tokenized"] - state["counters"]["tokens_in"]
    assert total.docs_per_row == sum(seen["docs"]) / (6 * B)
    assert total.masked_share == seen["masked"] / (6 * B * T) > 0
    assert after.total.tokens_emitted == total.tokens_emitted


def test_pretokenized_and_mixture_figures(corpus):
    common = dict(device="cpu", bos_token=BOS, buffer_size=16, chunk_size=64, batch_size=16,
                  workers=0)
    pretokenized = pretokenized_distributed_data_loader_with_state_bos_bestfit(
        B, T, "train", data_dir=str(corpus / "pretokenized"), **common)
    curriculum = [{"tokens": 10 * B * T, "mix": {"long": 0.5, "short": 0.5}}]
    mixture = pretokenized_mixture_loader_with_state_bos_bestfit(
        B, T, "train", curriculum, data_dir=str(corpus / "mixture"), **common)
    for loader in (pretokenized, mixture):
        seen = run(loader, 5)
        figures, stats = loader.figures(), loader.stats
        loader.close()
        total = figures.total
        assert (total.batches, total.tokens_emitted) == (5, 5 * B * T)
        assert total.tokens_tokenized == stats["tokens_tokenized"]
        assert total.crop_share == stats["crop_share"] > 0
        assert total.docs_per_row == sum(seen["docs"]) / (5 * B)
        assert total.masked_share == 0.0
    # the mixture's figures are its buckets' together
    assert total.tokens_tokenized == sum(s["tokens_tokenized"] for s in stats["buckets"].values())


# -----------------------------------------------------------------------------
# Streaming: what was downloaded and evicted


@pytest.mark.slow
def test_streaming_figures_count_downloads_and_evictions(tmp_path):
    hosted, cache = tmp_path / "hosted", tmp_path / "cache"
    hosted.mkdir()
    rng = random.Random(1)
    for i in list(range(6)) + [6542]:  # 6 train shards and the val shard
        texts = [f"shard {i} doc {j}: " + "".join(rng.choice("abcdefgh ")
                                                   for _ in range(rng.randint(1, 60)))
                 for j in range(200)]
        write_shard(str(hosted / index_to_filename(i)), texts, 32)
    sizes = {name: os.path.getsize(hosted / name) for name in os.listdir(hosted)}
    limit = int(4.2 * max(sizes.values()))  # about the least it accepts: it must evict
    server = ShardServer(str(hosted))
    try:
        loader = BESTFIT(
            ByteTokenizer(), 4, 64, "train", device="cpu", data_dir=str(cache), stream=True,
            num_shards=6, base_url=server.url, cache_limit=limit, prefetch_shards=0, prefetch=0,
            tokenizer_batch_size=8, buffer_size=20, workers=0,
            download_limits=Limits(max_attempts=2, backoff_base=0.01, timeout=5, deadline=30))
        for _ in range(40):  # a few shards in
            next(loader)
        first = loader.figures()
        for _ in range(200):  # through the epoch's last shard
            next(loader)
        # 10 s at most: until no download is in flight and the cache has stopped changing (a
        # kept copy may still be written just after a download ends)
        steady, used = 0, None
        for _ in range(1000):
            status = loader.cache_status()
            fetching = any(need.reason == "fetching" for need in status.needs)
            steady = steady + 1 if not fetching and status.used_bytes == used else 0
            used = status.used_bytes
            if steady == 5:
                break
            time.sleep(0.01)
        second = loader.figures()
        status = loader.cache_status()
        fetched = server.fetched()
        on_disk = [name for name in os.listdir(cache) if name.endswith(".parquet")]
        loader.close()
    finally:
        server.close()
    total = second.total
    assert total.bytes_downloaded == sum(sizes[name] for name in fetched)
    assert (first.since_last.bytes_downloaded + second.since_last.bytes_downloaded
            == total.bytes_downloaded)
    # every shard fetched and not on disk now was evicted, by this loader, the only one
    assert total.evictions == len(fetched) - len(on_disk) == status.evictions > 0
    assert first.since_last.evictions + second.since_last.evictions == total.evictions
    assert second.cache_limit == limit
    assert second.cache_bytes == status.used_bytes <= limit
    line = second.line()
    assert line.endswith(f" | cache {second.cache_bytes / 1e3:.1f}/{limit / 1e3:.1f} KB, "
                         f"{total.bytes_downloaded / 1e3:.1f} KB down, "
                         f"{total.evictions} evicted"), line



def test_the_line_rounds_to_three_digits_and_climbs_units():
    """A rate that rounds to 1000 of a unit is shown in the next one: 1.00M, never 1000k."""
    def line(tokenized_per_second: float) -> str:
        f = Figures(seconds=1.0, batches=1, wait_seconds=0.0, wait_share=0.0, tokens_tokenized=0,
                    tokens_emitted=0, tokenized_per_second=tokenized_per_second,
                    emitted_per_second=950, crop_share=0.1854, masked_share=0.0, docs_per_row=2.06,
                    bytes_downloaded=None, evictions=None)
        return LoaderFigures(f, f, None, None).line()

    assert line(999_999) == ("loader: wait 0.0% | 1.00M tok/s in, 950 out | crop 18.5% masked 0.0% "
                             "| 2.1 docs/row")
    assert line(987_000).startswith("loader: wait 0.0% | 987k tok/s in, ")
    assert line(12_345).startswith("loader: wait 0.0% | 12.3k tok/s in, ")


def test_pad_share_reads_the_masked_share():
    """pad_share, the field's other name, still reads: code that logs it keeps working."""
    then = Mark(0.0, 0.0, 0, {}, None, None)
    now = Mark(1.0, 0.0, 1, {"tokens_masked": 3, "rows": 1, "docs_placed": 2}, None, None)
    figures = stretch(then, now, 10)
    assert figures.pad_share == figures.masked_share == 0.3

"""
The cache budget (nanochat/data/streaming/budget.py). Pure, first: exact decisions on small splits
(the least cache_limit and its terms, whether a loader copies its buffered documents, the refusal's
lines, a resume's term; what no eviction may take, the order shards go in and how many), and
hypothesis properties of them (the least is never more than all the data unless the machine's
loaders evict, what goes is the shortest prefix that fits). Then through a loader (the budget check,
docs/streaming.md "The least cache_limit"): the refusal states the least in bytes, exactly, one line
per term, and it is what the check compares against (one byte less is refused, it is accepted); it
says the least once, ends on the one number to pass, and advises another data_dir only where the
cache holds something that counts against the limit. Small shards: the shards between the one
packed from and the one read are counted by the documents read ahead, and the least is never more
than all the data; a run at exactly the least gives the on-disk loader's batches. Shards are
served by a real HTTP server on 127.0.0.1.
"""

import math
import os
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import FAST, ByteTokenizer, least_accepted, write_shard
from nanochat.data.fetch.serve import ShardServer
from nanochat.data.streaming.budget import (Budget, Disk, ReadAhead, Term, copies_estimate,
                                            eviction_order, evictions, needed, read_ahead_span,
                                            refusal, size_up, budget_check)
from nanochat.data.streaming.ledger import STREAM_DIR
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit as bestfit
from nanochat.data.base.datasets import index_to_filename


VAL = index_to_filename(6542)  # the default dataset's val shard
# 5 train shards of ~67 KB, row groups of 20 documents of 400 letters; shard 2 holds 20 documents
DOCS = [200, 200, 20, 200, 200]
# B=4, T=64; read-ahead: (5 x prefetch + 3) x tokenizer_batch_size = 64 documents, more than
# shard 2 holds, fewer than the others; prefetch_shards=0
SMALL = dict(B=4, T=64, tokenizer_batch_size=8, prefetch=1, buffer_size=16, prefetch_shards=0)
READ_AHEAD = (5 * 1 + 3) * 8


# -----------------------------------------------------------------------------
# Pure: sizes in, decisions out

# 5 shards of 100..500 bytes; the val shard, 50 bytes, not on disk yet; 2 local ranks
SPLIT = Budget(limit=1429, names=[f"s{i}" for i in range(5)], sizes=[100, 200, 300, 400, 500],
               keep={"val": 50}, prefetch_shards=0, packing=ReadAhead(10, 4, 5.0),
               copies_each=30, local_ranks=2)
# shard s0 fetched by a streaming loader; "mine", 70 bytes, the user's; 20 bytes of copies kept
DISK = Disk("D", "D/.stream/ledger.json", {"s0": 100, "mine": 70}, {"s0"}, 20, False)


def test_the_least_is_the_sum_of_its_terms_each_exact():
    verdict = budget_check(SPLIT, DISK)
    # the walk: the one read, the one packed from and one for a rank out of step, the 3 largest
    # (500 + 400 + 300); the 2 between those two by their documents, 10 x 5.0 bytes (< 200 + 100)
    assert [term.nbytes for term in verdict.terms] == [1200, 50, 50, 60, 70]
    assert [term.what for term in verdict.terms] == [
        "shards read, packed from and fetched ahead", "shards read between those two",
        "the val shard", "copies of buffered documents", "shards it may not evict"]
    assert verdict.terms[4] == Term("shards it may not evict", "1 in D: 1 that the ledger "
                                    "D/.stream/ledger.json does not list as fetched by a "
                                    "streaming loader", 70)
    assert verdict.least == 1430
    assert verdict.everything == 1500 + 50 + 70 + 20  # the split, val, the user's, the copies
    # below all of it: shards will be evicted, so buffered documents are copied
    assert (verdict.copying, verdict.copies, verdict.own, verdict.restoring) == (
        True, 30, ["mine"], False)


def test_the_refusal_names_each_term_and_ends_on_the_least():
    verdict = budget_check(SPLIT, DISK)
    lines = refusal(SPLIT, DISK, verdict).split("\n")
    assert lines[0] == ("cache_limit=1,429 bytes is below what this streaming loader must hold "
                        "at once, 1,430 bytes (1.43 KB):")
    assert lines[1] == ("  shards read, packed from and fetched ahead: the 3 largest whole: the "
                        "one read, the one packed from, prefetch_shards=0 ahead and one for a "
                        "local rank out of step (at most the split's 5): 1,200 bytes")
    assert lines[2] == ("  shards read between those two: 10 documents read ahead at most, at the "
                        "split's most 5.0 bytes of a shard per document a rank reads: 50 bytes")
    assert lines[6] == ("To need less: lower prefetch_shards, prefetch, tokenizer_batch_size or "
                        "buffer_size; or use another data_dir: in D, 1 shard(s) no streaming "
                        "loader fetched count against the limit.")
    assert lines[7:] == ["pass cache_limit=1430 or more"]


def test_a_limit_that_holds_everything_copies_nothing_unless_the_machine_evicts():
    fits = budget_check(SPLIT._replace(limit=1640), DISK)
    assert (fits.least, fits.copying, fits.copies) == (1430, False, 0)
    # the machine's loaders evict already: every loader copies, and the least is the terms' sum
    # even when all the data is less
    small = DISK._replace(on_disk={}, evicting=True)
    evicting = budget_check(SPLIT._replace(limit=10**6, copies_each=10**4), small)
    assert evicting.copying and evicting.copies == 1500  # (at most the split's bytes)
    assert evicting.least == 1200 + 50 + 50 + 1500 * 2 > evicting.everything == 1570
    assert budget_check(SPLIT._replace(limit=None), DISK) == (0, [], 0, False, 0, [], False)


def test_a_resume_term_replaces_the_walks_when_it_is_more():
    # shards 3 and 4 (400 + 500) and 500 for a local rank out of step: more than the walk's 1,250
    verdict = budget_check(SPLIT, DISK, [3, 4])
    assert verdict.terms[0].what == "shards a resume reads first"
    assert [term.nbytes for term in verdict.terms] == [1400, 50, 60, 70]
    assert verdict.restoring and verdict.least == 1580
    assert not refusal(SPLIT, DISK, verdict).count("lower prefetch_shards")  # the state decides
    # shard 4 alone, 500 + 500, is within the walk: no term of its own
    assert [term.nbytes for term in budget_check(SPLIT, DISK, [4]).terms] == [1200, 50, 50, 60, 70]


class Row:
    """A ledger row as the eviction decisions read it."""

    def __init__(self, needs=None, later=()):
        self.needs, self.later = needs or {}, later


def test_what_no_eviction_may_take():
    loaders = {"other": Row({"x": "reading", "y": "buffered"}),
               "me": Row({"z": "buffered", "w": "ahead"})}
    assert needed(loaders, {"val": 50}, "me") == {"val", "x", "y", "z", "w"}
    # our own buffered shard whose copy is being written may go; another loader's may not
    assert needed(loaders, {"val": 50}, "me", release="z") == {"val", "x", "y", "w"}
    assert needed(loaders, {"val": 50}, "me", release="y") == {"val", "x", "y", "z", "w"}


def test_the_order_shards_go_in():
    mtimes = {"a": 4.0, "b": 3.0, "c": 1.0, "d": 2.0}
    # none read soon: `release` first, then the oldest
    assert eviction_order(list("abcd"), {}, "d", mtimes) == ["d", "c", "b", "a"]
    assert eviction_order(list("abcd"), {}, None, mtimes) == ["c", "d", "b", "a"]
    # a and c read soon (c next, a one shard on at the soonest): after the others, the one read
    # latest first
    loaders = {"1": Row(later=("c", "x", "a")), "2": Row(later=("y", "a"))}
    assert eviction_order(list("abcd"), loaders, None, mtimes) == ["d", "b", "a", "c"]


def test_how_many_go():
    sizes = {"a": 300, "b": 200, "c": 500}
    assert evictions(1000, 600, list("abc"), sizes) == ["a", "b"]  # 700, then 500: fits
    assert evictions(600, 600, list("abc"), sizes) == []
    assert evictions(2000, 600, list("abc"), sizes) == ["a", "b", "c"]  # not enough: all


sizes_st = st.lists(st.integers(1, 10**6), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(sizes=sizes_st, limit=st.integers(0, 10**7), prefetch_shards=st.integers(0, 4),
       shards=st.integers(1, 6), docs=st.integers(0, 1000), doc_bytes=st.floats(0, 1e4),
       copies=st.integers(0, 10**6), ranks=st.integers(1, 4), kept=st.integers(0, 10**5),
       evicting=st.booleans(), restore=st.lists(st.integers(0, 7), max_size=4))
def test_the_least_is_never_more_than_all_the_data_unless_the_machine_evicts(
        sizes, limit, prefetch_shards, shards, docs, doc_bytes, copies, ranks, kept, evicting,
        restore):
    names = [f"s{i}" for i in range(len(sizes))]
    budget = Budget(limit, names, sizes, {"val": 7}, prefetch_shards,
                    ReadAhead(docs, shards, doc_bytes), copies, ranks)
    disk = Disk("D", "L", {}, set(), kept, evicting)
    verdict = budget_check(budget, disk, sorted({p % len(sizes) for p in restore}))
    total = sum(term.nbytes for term in verdict.terms)
    assert verdict.least == (total if evicting else min(total, verdict.everything))
    assert verdict.everything == sum(sizes) + 7 + kept
    assert verdict.copying == (limit < verdict.everything or evicting)
    assert verdict.copies == (min(copies, sum(sizes)) if verdict.copying else 0)
    assert all(term.nbytes >= 0 for term in verdict.terms)
    # the walk's whole shards: never more than the split has
    assert verdict.terms[0].nbytes <= sum(sizes) + max(sizes) * (ranks > 1)
    # the limit decides nothing but whether it suffices
    again = budget_check(budget._replace(limit=limit + 1), disk, sorted({p % len(sizes)
                                                                        for p in restore}))
    assert (again.least, again.terms) == (verdict.least, verdict.terms)


@settings(max_examples=300, deadline=None)
@given(sizes=sizes_st, used=st.integers(0, 10**7), limit=st.integers(0, 10**7))
def test_what_goes_is_the_shortest_prefix_that_fits(sizes, used, limit):
    order = [f"s{i}" for i in range(len(sizes))]
    size_of = dict(zip(order, sizes))
    gone = evictions(used, limit, order, size_of)
    assert gone == order[:len(gone)]
    left = used - sum(size_of[n] for n in gone)
    assert left <= limit or gone == order  # it fits, or nothing more can go
    if gone:  # one fewer would not have fit
        assert left + size_of[gone[-1]] > limit


@pytest.fixture
def hosted_uneven(tmp_path):
    directory = tmp_path / "hosted"
    os.makedirs(directory)
    for i, n in enumerate(DOCS):
        rng = random.Random(i)
        texts = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=400)) for _ in range(n)]
        write_shard(directory / index_to_filename(i), texts, 20)
    write_shard(directory / VAL, ["val document"] * 20, 20)
    server = ShardServer(str(directory))
    yield directory, server
    server.close()


def _loader(data_dir, server=None, **settings):
    stream = {} if server is None else dict(stream=True, num_shards=len(DOCS),
                                            base_url=server.url, download_limits=FAST)
    kwargs = dict(split="train", device="cpu", workers=0) | SMALL | stream | settings
    return bestfit(ByteTokenizer(), data_dir=str(data_dir), **kwargs)


def _sizes(hosted) -> list[int]:
    return [os.path.getsize(hosted / index_to_filename(i)) for i in range(len(DOCS))]


def _batches(loader, n: int) -> list:
    out = []
    for inputs, targets, state in loader:
        out.append((inputs.clone(), targets.clone(), state))
        if len(out) == n:
            break
    return out


def test_the_refusal_states_the_least_exactly_and_the_least_is_accepted(hosted_uneven, tmp_path):
    directory, server = hosted_uneven
    sizes, val = _sizes(directory), os.path.getsize(directory / VAL)
    least = least_accepted(lambda limit: _loader(tmp_path / "probe", server, cache_limit=limit))
    # the terms, counted here from the files: the 3 largest shards whole (the one read, the one
    # packed from, one for a local rank out of step); the 64 documents read ahead between them at
    # the split's most bytes per document; the val shard; the copies of 16 buffered documents
    largest_first = sorted(sizes, reverse=True)
    between = math.ceil(READ_AHEAD * max(size / n for size, n in zip(sizes, DOCS)))
    entries = [{"size": size, "rows": [n]} for size, n in zip(sizes, DOCS)]
    copies = copies_estimate(entries, 16)
    assert between < sum(largest_first[3:5])  # (fewer bytes than 2 whole shards)
    assert least == sum(largest_first[:3]) + between + val + copies
    fetched = server.fetched()  # (the probe's, at the limits it accepted)
    with pytest.raises(ValueError) as raised:
        _loader(tmp_path / "cache", server, cache_limit=least - 1)
    assert server.fetched() == fetched  # refused before any download
    lines = str(raised.value).split("\n")
    assert lines[0] == (f"cache_limit={least - 1:,} bytes is below what this streaming loader "
                        f"must hold at once, {least:,} bytes ({size_up(least)}):")
    assert lines[1] == (
        "  shards read, packed from and fetched ahead: the 3 largest whole: the one read, the one "
        "packed from, prefetch_shards=0 ahead and one for a local rank out of step (at most the "
        f"split's 5): {sum(largest_first[:3]):,} bytes")
    per_doc = max(size / n for size, n in zip(sizes, DOCS))
    assert lines[2] == (
        f"  shards read between those two: 64 documents read ahead at most, at the split's most "
        f"{per_doc:,.1f} bytes of a shard per document a rank reads: {between:,} bytes")
    assert lines[3] == f"  the val shard: not on disk yet, never evicted: {val:,} bytes"
    assert lines[4].startswith("  copies of buffered documents: ")
    assert lines[4].endswith(f"for each of 1 local rank(s): {copies:,} bytes")
    # the terms add up to the least, said once (the first line); a read-ahead lowers it, and the
    # new, empty cache holds nothing another data_dir would spare; last, the number to pass
    assert lines[5:] == ["To need less: lower prefetch_shards, prefetch, tokenizer_batch_size or "
                         "buffer_size.", f"pass cache_limit={least} or more"]
    _loader(tmp_path / "cache", server, cache_limit=least).close()


def test_the_refusal_says_each_thing_once_and_ends_on_the_number_to_pass(hosted_uneven, tmp_path):
    """The least is said once, on the first line, beside its terms; the last line is the one
    number to pass. Another data_dir is advised only where the cache holds something that counts
    against the limit (not a new, empty one): here a shard of the user's, which the ledger (named)
    does not list as fetched by a streaming loader."""
    directory, server = hosted_uneven
    least = least_accepted(lambda limit: _loader(tmp_path / "probe", server, cache_limit=limit))
    with pytest.raises(ValueError) as raised:
        _loader(tmp_path / "new", server, cache_limit=least // 2)
    message = str(raised.value)
    lines = message.split("\n")
    assert lines[-1] == f"pass cache_limit={least} or more"
    assert len(lines) == len(set(lines)) and message.count(f"{least:,}") == 1
    assert "data_dir" not in message
    own = tmp_path / "own"
    os.makedirs(own)
    write_shard(own / "mine.parquet", ["a document of the user's own"] * 40, 20)
    mine = os.path.getsize(own / "mine.parquet")
    with pytest.raises(ValueError) as raised:
        _loader(own, server, cache_limit=least)
    lines = str(raised.value).split("\n")
    ledger = own / STREAM_DIR / "ledger.json"
    assert (f"  shards it may not evict: 1 in {own}: 1 that the ledger {ledger} does not list as "
            f"fetched by a streaming loader: {mine:,} bytes") in lines
    assert lines[-2] == ("To need less: lower prefetch_shards, prefetch, tokenizer_batch_size or "
                         f"buffer_size; or use another data_dir: in {own}, 1 shard(s) no streaming "
                         "loader fetched count against the limit.")
    assert lines[-1] == f"pass cache_limit={least + mine} or more"
    _loader(own, server, cache_limit=least + mine).close()


@pytest.mark.slow
def test_small_shards_least_is_below_whole_shards_and_a_run_at_it_gives_the_on_disk_batches(
        hosted_uneven, tmp_path):
    """Shard 2 holds fewer documents than the loader reads ahead: counted in whole shards, the
    read-ahead spans all 5 (1 + ceil(64 / 20) from the one packed from to the one read, 2 of
    them whole); counted in documents, the shards between take a third of one. At exactly the
    least, 2 epochs stream with evictions, within the limit, and equal the on-disk loader's."""
    directory, server = hosted_uneven
    sizes, val = _sizes(directory), os.path.getsize(directory / VAL)
    least = least_accepted(lambda limit: _loader(tmp_path / "probe", server, cache_limit=limit))
    entries = [{"size": size, "rows": [n]} for size, n in zip(sizes, DOCS)]
    whole_shards = min(1 + math.ceil(READ_AHEAD / min(DOCS)) + 0 + 1, len(DOCS))
    assert whole_shards == 5
    copies = copies_estimate(entries, 16)
    assert least < whole_shards * max(sizes) + val + copies  # the least in whole shards
    assert least < sum(sizes) + val  # less than all the data: shards are evicted

    probed = server.fetched()
    n = sum(DOCS) // 4 * 2  # ~2 epochs: a row takes one 400-letter document (cropped to 65)
    expected = _batches(_loader(directory), n)
    loader = _loader(tmp_path / "cache", server, cache_limit=least)
    got = _batches(loader, n)
    status = loader.cache_status()
    loader.close()
    assert len(got) == len(expected) == n
    for i, ((a, b, s), (x, y, t)) in enumerate(zip(got, expected)):
        assert torch.equal(a, x) and torch.equal(b, y) and s == t, f"batch {i}"
    assert status.evictions > 0 and status.peak_bytes <= least
    fetched = server.fetched()[len(probed):]
    # every train shard, some again in the second epoch (a train loader does not fetch val)
    assert len(fetched) > len(set(fetched)) == len(DOCS)


@pytest.mark.slow
def test_the_least_is_never_more_than_all_the_data(hosted_uneven, tmp_path):
    """The default read-ahead, (5 x 4 + 3) x 128 documents, spans every shard of these small ones,
    and the copies of 1,000 buffered documents would take more than a shard: the terms' sum is more
    than all the data. At all of it nothing is ever evicted, so that is the least; a run at it
    streams every shard once."""
    directory, server = hosted_uneven
    sizes, val = _sizes(directory), os.path.getsize(directory / VAL)
    everything = sum(sizes) + val
    settings = dict(tokenizer_batch_size=128, prefetch=4, buffer_size=1000, prefetch_shards=2)
    least = least_accepted(lambda limit: _loader(tmp_path / "probe", server, cache_limit=limit,
                                                 **settings))
    assert least == everything
    with pytest.raises(ValueError) as raised:
        _loader(tmp_path / "cache", server, cache_limit=least - 1, **settings)
    lines = str(raised.value).split("\n")
    assert lines[0].endswith(f"must hold at once, {everything:,} bytes ({size_up(everything)}):")
    # the terms' sum is said as theirs, beside all the data, the least; the number to pass last
    total = sum(int(line.rsplit(": ", 1)[1].removesuffix(" bytes").replace(",", ""))
                for line in lines[1:-3])
    assert total > everything
    assert lines[-3] == (f"  these add up to {total:,} bytes, more than all the shards it may hold "
                         f"and the copies kept, {everything:,} bytes: at that limit no shard is "
                         "ever evicted, so that is the least")
    assert lines[-1] == f"pass cache_limit={everything} or more"
    probed = server.fetched()
    n = sum(DOCS) // 4 + 5  # past the end of the first epoch
    expected = _batches(_loader(directory, **settings), n)
    loader = _loader(tmp_path / "cache", server, cache_limit=least, **settings)
    got = _batches(loader, n)
    status = loader.cache_status()
    loader.close()
    for i, ((a, b, s), (x, y, t)) in enumerate(zip(got, expected)):
        assert torch.equal(a, x) and torch.equal(b, y) and s == t, f"batch {i}"
    assert status.evictions == 0 and not status.copying
    # every train shard fetched once
    assert sorted(server.fetched()[len(probed):]) == [index_to_filename(i) for i in range(5)]


def test_read_ahead_span():
    """The span of 64 documents read ahead over shards of 200, 20 and 200 documents in row groups
    of 20 (3 ranks: rank 0 reads 4 row groups of a 200 shard, 80 documents, and all of the 20)."""
    entries = [{"size": 1000, "rows": [20] * 10}, {"size": 150, "rows": [20]},
               {"size": 2000, "rows": [20] * 10}]
    assert read_ahead_span(entries, range(1), 1, 64) == ReadAhead(64, 1 + 4, 10.0)
    # rank 0 reads 80 of the 200s (2000 / 80 = 25 bytes a document), 20 of shard 1; rank 1
    # does not visit shard 1 (one row group) and reads 60 of the 200s: 2000 / 60
    assert read_ahead_span(entries, range(1), 3, 64) == ReadAhead(64, 1 + 4, 25.0)
    assert read_ahead_span(entries, range(2), 3, 64) == ReadAhead(64, 1 + 4, 2000 / 60)
    assert read_ahead_span(entries, [1], 3, 64) == ReadAhead(64, 1 + 2, 2000 / 60)
    # a shard a rank visits holds none of its documents: only whole shards bound the span
    empty = [{"size": 500, "rows": [0, 20]}] + entries
    assert read_ahead_span(empty, [0], 2, 64).doc_bytes == math.inf


def test_size_up_is_never_below_the_size():
    assert size_up(1_900_000) == "1.90 MB"
    assert size_up(1_900_001) == "1.91 MB"
    assert size_up(19_000_001) == "19.1 MB"
    assert size_up(999_000_001) == "1.00 GB"  # not "1000 MB"
    assert size_up(999_499) == "1.00 MB"
    assert size_up(2_000_000_000) == "2.00 GB"
    assert size_up(1_001) == "1.01 KB"
    assert size_up(999) == "999 bytes"

"""
The cache budget, pure: sizes in, decisions (what must be held, what may be evicted) out.
Whether cache_limit holds what a streaming loader must hold at once (the budget check, its terms in
bytes, the message of a refusal), what may be evicted and in which order, and the estimates the
check counts (documents read ahead, copies of buffered documents). No I/O, no threads, no clock:
the cache reads the disk and the ledger, and passes their figures in. Design: docs/streaming.md.

May import: nothing of the project (no I/O, no threads, no clock).
"""

import math
from typing import NamedTuple


class ReadAhead(NamedTuple):
    """What the documents a loader has read and not yet packed can span, for the budget check: its
    local ranks' most (they share the cache)."""
    docs: int  # documents read and not yet packed, at most
    shards: int  # the most shards from the one packed from to the one read, both included
    # the most bytes a shard's file takes per document a rank reads of it; inf when a rank reads
    # a shard that has none of its documents (then only whole shards bound the span)
    doc_bytes: float


class Budget(NamedTuple):
    """One loader's side of the budget check: its split, its limit and what it reads ahead."""
    limit: int | None  # cache_limit in bytes; None: no budget
    names: list[str]  # the split's shards
    sizes: list[int]  # their bytes, aligned with names
    keep: dict[str, int]  # name -> bytes of the shards never evicted (the val shard)
    prefetch_shards: int
    packing: ReadAhead  # what the shards from the one packed from to the one read hold
    copies_each: int  # what copies of one rank's buffer may take (copies_estimate)
    local_ranks: int  # the ranks of this machine: each keeps copies of its buffer


class Disk(NamedTuple):
    """The machine's side of the budget check: a snapshot of the cache's directory and ledger."""
    data_dir: str
    ledger_path: str
    on_disk: dict[str, int]  # name -> bytes of every complete shard in data_dir
    fetched: set[str]  # the shards the ledger lists as fetched by a streaming loader
    kept: int  # bytes of every kept copy of buffered documents
    evicting: bool  # the ledger says this machine's loaders evict already


class Term(NamedTuple):
    """One term of the least cache_limit (the budget check)."""
    what: str
    how: str  # how it is counted
    nbytes: int


class Verdict(NamedTuple):
    """The budget check's decision: the least cache_limit, its terms, and the copies it sets
    aside."""
    least: int  # the least cache_limit that holds what must be held at once
    terms: list[Term]
    everything: int  # every shard the cache may hold and the copies kept, at once
    copying: bool  # whether this loader copies its buffered documents
    copies: int  # the room set aside for one rank's copies (0 when it makes none)
    own: list[str]  # shards on disk no streaming loader fetched (the user's)
    restoring: bool  # whether a resume's first documents decide the least


# -----------------------------------------------------------------------------
# The budget check


def budget_check(budget: Budget, disk: Disk, restore: list[int] = ()) -> Verdict:
    """What must be held at once (`restore`: the shards of resumed walks' first documents), and
    whether this loader copies its buffered documents. Fits when budget.limit >= verdict.least."""
    if budget.limit is None:
        return Verdict(0, [], 0, False, 0, [], False)
    # (a partial download is not fixed: it becomes a fetched shard, or this loader resumes it)
    fixed = {n: size for n, size in disk.on_disk.items()
             if n not in disk.fetched or n in budget.keep}
    # all of it at once: every shard the cache may hold and the copies already kept. At a limit
    # that holds it no shard is ever evicted, so no copies of buffered documents are made and
    # nothing can wait for room (unless this machine's loaders evict already)
    everything = (sum((dict(zip(budget.names, budget.sizes)) | budget.keep | fixed).values())
                  + disk.kept)
    copying = budget.limit < everything or disk.evicting
    keeps_all = not set(budget.names) - set(budget.keep)  # (a val loader: its shard never goes)
    copies = 0 if keeps_all else min(budget.copies_each, sum(budget.sizes))
    terms = walk_terms(budget)
    restoring = restore_term(budget, restore, sum(term.nbytes for term in terms))
    terms = [restoring] if restoring else terms
    val_bytes = sum(size for name, size in budget.keep.items()
                    if name not in disk.on_disk and name not in budget.names)
    if val_bytes:  # (a val loader, an eval during training, has yet to fetch it)
        terms.append(Term("the val shard", "not on disk yet, never evicted", val_bytes))
    if copies:
        terms.append(Term("copies of buffered documents", (
            f"{copies:,} bytes (copies_estimate: twice buffer_size documents at the split's "
            f"most bytes per document) for each of {budget.local_ranks} local rank(s)"),
            copies * budget.local_ranks))
    own = sorted(n for n in fixed if n not in budget.keep)  # (the user's, by the ledger)
    if fixed:
        kinds = ["the val shard"] if len(own) < len(fixed) else []
        if own:
            kinds.append(f"{len(own)} that the ledger {disk.ledger_path} does not list as "
                         "fetched by a streaming loader")
        terms.append(Term("shards it may not evict", (
            f"{len(fixed)} in {disk.data_dir}: " + " and ".join(kinds)), sum(fixed.values())))
    total = sum(term.nbytes for term in terms)
    least = total if disk.evicting else min(total, everything)
    return Verdict(least, terms, everything, copying, copies if copying else 0, own,
                   restoring is not None)


def walk_terms(budget: Budget) -> list[Term]:
    """What a walk under way holds at once: the shards from the one packed from to the one
    read, those fetched ahead and one for a local rank out of step. Its terms count the split's
    largest shards, never more shards than the split has."""
    n, ahead, prefetch_shards = len(budget.names), budget.packing, budget.prefetch_shards
    largest_first = sorted(budget.sizes, reverse=True)
    # the shard packed from and the shard read are files on disk, whole (one when the reader
    # reads no more than the packer takes)
    ends = min(ahead.shards, 2)
    whole = min(ends + prefetch_shards + 1, n)
    terms = [Term("shards read, packed from and fetched ahead", (
        f"the {whole} largest whole: the one read, the one packed from, "
        f"prefetch_shards={prefetch_shards} ahead and one for a local rank out of step "
        f"(at most the split's {n})"), sum(largest_first[:whole]))]
    # the shards between those two: the reader has read all of them and the packer has yet to
    # pack them, so their documents (of this rank's) are among the `docs` read ahead
    middle = min(ahead.shards - ends, n - whole)
    if middle > 0:
        shards_bytes = sum(largest_first[whole:whole + middle])
        # (inf: a rank visits a shard with none of its documents; only whole shards bound it)
        docs_bytes = ahead.docs * ahead.doc_bytes if ahead.docs else 0
        if docs_bytes < shards_bytes:
            terms.append(Term("shards read between those two", (
                f"{ahead.docs:,} documents read ahead at most, at the split's most "
                f"{ahead.doc_bytes:,.1f} bytes of a shard per document a rank reads"),
                math.ceil(docs_bytes)))
        else:
            terms.append(Term("shards read between those two", (
                f"the next {middle} largest whole ({ahead.docs:,} documents read ahead span "
                "them at most)"), shards_bytes))
    return terms


def restore_term(budget: Budget, restore: list[int], walk: int) -> Term | None:
    """A resumed walk's first documents (a buffer's, a merged plan's), the local ranks'
    together, and the file the walk goes on in are held at once, with one for a local rank out
    of step when there are more (what is fetched ahead waits for room meanwhile): a term when
    that is more than a walk under way holds."""
    if not restore:
        return None
    largest = max(budget.sizes)
    restoring = sum(budget.sizes[p] for p in restore)
    step = largest * (budget.local_ranks > 1 and len(restore) < len(budget.names))
    if restoring + step <= walk:
        return None
    return Term("shards a resume reads first", (
        f"{len(restore)} holding the first documents of the resumed walks of this machine's "
        "ranks (their buffers, a merge's plans) and the files the walks go on in"
        + (f", and {step:,} bytes for a local rank out of step" if step else "")
        + f": more than the {walk:,} bytes a walk under way holds"), restoring + step)


def refusal(budget: Budget, disk: Disk, verdict: Verdict) -> str:
    """The budget check's message: the least, its terms, what lowers it, and last the one
    number to pass."""
    least, terms = verdict.least, verdict.terms
    lines = [f"cache_limit={budget.limit:,} bytes is below what this streaming loader must hold "
             f"at once, {least:,} bytes ({size_up(least)}):"]
    lines += [f"  {term.what}: {term.how}: {term.nbytes:,} bytes" for term in terms]
    total = sum(term.nbytes for term in terms)
    if least < total:
        lines.append(f"  these add up to {total:,} bytes, more than all the shards it may hold "
                     f"and the copies kept, {verdict.everything:,} bytes: at that limit no shard "
                     "is ever evicted, so that is the least")
    elif verdict.everything < total:
        lines.append(f"  all the shards it may hold and the copies kept take "
                     f"{verdict.everything:,} bytes, less, but the ledger {disk.ledger_path} says "
                     "this machine's loaders evict already: the least is the terms' sum")
    # a smaller read-ahead lowers the least (at all the data too: the sum may fall below it),
    # unless a resume's state decides what it holds
    fixes = [] if verdict.restoring else [
        "lower prefetch_shards, prefetch, tokenizer_batch_size or buffer_size"]
    kept = disk.kept if least < total else 0  # (in all of it)
    own = verdict.own
    if own or kept:  # (another data_dir lowers the least only when this one holds something)
        held = [f"{len(own)} shard(s) no streaming loader fetched"] if own else []
        if kept:
            held.append(f"{kept:,} bytes of copies kept")
        fixes.append(f"use another data_dir: in {disk.data_dir}, "
                     f"{' and '.join(held)} count against the limit")
    if fixes:
        lines.append("To need less: " + "; or ".join(fixes) + ".")
    lines.append(f"pass cache_limit={least} or more")
    return "\n".join(lines)


def size_up(nbytes: int) -> str:
    """A size in words rounded up, to 3 significant digits: never shown below what it is."""
    if nbytes < 1e3:
        return f"{nbytes} bytes"
    for unit, scale in (("KB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        digits = 2 if nbytes < 10 * scale else 1 if nbytes < 100 * scale else 0
        step = scale / 10 ** digits
        up = math.ceil(nbytes / step) * step / scale
        if up < 1000 or unit == "GB":  # 999.9 MB rounded up is 1.00 GB, not "1000 MB"
            return f"{up:.{digits}f} {unit}"


# -----------------------------------------------------------------------------
# Eviction


def needed(loaders: dict, keep, owner: str, release: str | None = None) -> set[str]:
    """The shards no eviction may take: `keep` (the val shard) and what every live loader's entry
    (the ledger's, by owner) needs. `release`: a shard the `owner`'s buffers need only until the
    copy being written now (it may go)."""
    held = set(keep)
    for who, entry in loaders.items():
        # buffered: documents not copied yet; `release` is being copied now
        held.update(n for n, reason in entry.needs.items()
                    if not (reason == "buffered" and who == owner and n == release))
    return held


def eviction_order(victims: list[str], loaders: dict, release: str | None,
                   mtimes: dict[str, float]) -> list[str]:
    """The shards that may go, in the order they go: those no live loader reads soon first
    (`release` before the rest, then the oldest by mtime), then those read latest."""
    # soonest: where a live loader reads a shard next, in distinct shards from now
    soonest: dict[str, int] = {}
    for entry in loaders.values():
        for i, n in enumerate(entry.later):
            soonest[n] = min(soonest.get(n, i), i)
    return sorted(victims, key=lambda n: (n in soonest, -soonest.get(n, 0), n != release,
                                          mtimes[n]))


def evictions(used: int, limit: int, candidates: list[str], sizes: dict[str, int]) -> list[str]:
    """The first shards of `order` to evict so that `used` bytes fall to `limit` (all of them
    when that is not enough)."""
    gone = []
    for victim in candidates:
        if used <= limit:
            break
        gone.append(victim)
        used -= sizes[victim]
    return gone


# -----------------------------------------------------------------------------
# The estimates of the budget check


def packing_shards(entries: list[dict], rank: int, world_size: int, read_ahead: int) -> int:
    """The most shards that `read_ahead` documents (read and not yet packed) and the one the reader
    has just opened can span for this rank: one more than its fewest documents of a shard (its row
    groups of it) divide them into."""
    shares = [sum(entry["rows"][rank::world_size]) for entry in entries]
    return 1 + math.ceil(read_ahead / max(min((n for n in shares if n), default=1), 1))


def read_ahead_span(entries: list[dict], ranks, world_size: int, docs: int) -> ReadAhead:
    """The span of `docs` documents read ahead, the most over `ranks` (a machine's local ranks)."""
    shards, doc_bytes = 1, 0.0
    for rank in ranks:
        shards = max(shards, packing_shards(entries, rank, world_size, docs))
        for entry in entries:
            if len(entry["rows"]) > rank:  # (a shard the rank visits: it has a row group of its)
                share = sum(entry["rows"][rank::world_size])
                doc_bytes = max(doc_bytes, entry["size"] / share if share else math.inf)
    return ReadAhead(docs, shards, doc_bytes)


def copies_estimate(entries: list[dict], buffer_docs: int) -> int:
    """What the copies of `buffer_docs` buffered documents may take, an estimate: twice their bytes
    at the split's most bytes per document of a shard (best-fit keeps long documents waiting)."""
    per_doc = max(entry["size"] / max(sum(entry["rows"]), 1) for entry in entries)
    return int(2 * buffer_docs * per_doc)

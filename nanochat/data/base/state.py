"""
The loader state's format, and how it is built after each batch.
StateRecorder builds it. The records name a document (DocKey, WindowKey, PieceKey), a plan's work
(PlanUnit) or a place in the walk (Position, Cursor, WindowCursor); UnitIndex counts the units;
then the state's compact encodings, its fingerprints and its checksum. A state names documents by
where they were read, never by their tokens: a few KB at buffer_size=1000. state_checks.py checks
and resumes a state; nanochat/data/loader/elastic.py merges the states of N ranks for M. Format:
docs/resume.md.

Cost per batch: ~0.15 ms to encode a 1,000-document buffer, ~0.15 ms to hash a 32x2049 batch.

May import: the standard library and numpy only.
"""

import base64
import bisect
import hashlib
import itertools
import json
import os
from operator import itemgetter
from typing import NamedTuple

import numpy as np

VERSION = 2
EMPTY_HASH = "0" * 32  # the emitted hash before the first batch


class DocKey(NamedTuple):
    """One document: where it was read (doc_index: its index in the unit)."""
    epoch: int
    pq_idx: int
    rg_idx: int
    doc_index: int


class WindowKey(NamedTuple):
    """One document of a shuffled walk, by position: the i-th entry of its window's order."""
    epoch: int
    window: int
    i: int


class PieceKey(NamedTuple):
    """A document from token `start` on: one piece of a split document, dealt alone by a merge."""
    epoch: int
    pq_idx: int
    rg_idx: int
    doc_index: int
    start: int


class PlanUnit(NamedTuple):
    """Work a plan deals: some documents of a unit, or the whole unit."""
    epoch: int
    pq_idx: int
    rg_idx: int
    doc_indices: tuple | None  # the unit's documents to read, in order; None: all of them
    starts: tuple | None  # aligned with doc_indices: None for a whole document, else a start


class Position(NamedTuple):
    """nanochat's state keys: the unit of the last document batch consumed."""
    pq_idx: int
    rg_idx: int
    epoch: int


class Cursor(NamedTuple):
    """Where the regular walk goes on (a state's "next"): the document batch from document
    `doc_index` of a unit."""
    epoch: int
    pq_idx: int
    rg_idx: int
    doc_index: int


class WindowCursor(NamedTuple):
    """Where a shuffled walk goes on (a state's "next"): the i-th entry of a window's order."""
    epoch: int
    window: int
    i: int


class Progress(NamedTuple):
    """Where a walk stands after the last document batch pulled: what a state records of it."""
    plan: list  # the PlanUnits of its plan not yet read
    cursor: Cursor | WindowCursor  # where the regular walk goes on after the plan
    position: Position  # nanochat's keys of that batch


# -----------------------------------------------------------------------------
# Building the state of each batch


class StateRecorder:
    """Builds the state yielded with each batch, and restores a packer from the resumed one.
    order: the rank's walk (a RankOrder: index, its units; state_name, what messages call the
    resumed state) and encoder, kept for the packing stage, which reads the resumed buffer with them
    (nanochat/data/loader/rows.py); resumed: a version-2 state that continues this walk, or None;
    watch: called with each state's buffered keys and the file (epoch, pq_idx) the walk goes on in
    (a streaming loader keeps on disk what a resume from that state reads)."""

    def __init__(self, kind: str, order, encoder, config: dict, resumed: dict | None, watch=None):
        self.kind, self.config, self.resumed, self.watch = kind, config, resumed, watch
        self.order, self.encoder = order, encoder
        self.index, self.state_name = order.index, order.state_name
        emitted = resumed["emitted"] if resumed else {"batches": 0, "tokens": 0, "hash": EMPTY_HASH}
        self.batches, self.tokens, self.hash = (emitted["batches"], emitted["tokens"],
                                                emitted["hash"])
        self._plan_cache: tuple = (None, None)  # (key, the plan's tail encoded): _plan_items
        self._encode_keys = KeyEncoder()  # the buffer's keys, each numbered once

    def buffered(self) -> tuple[list, list]:
        """The resumed buffer: its keys in arrival order, and per key the token its piece starts at
        (None: a whole document). Its size was checked: state_checks.check_fields."""
        if not self.resumed:
            return [], []
        keys = decode_keys(self.resumed["buffer"])
        return keys, decode_pieces(self.resumed.get("pieces", []), len(keys))

    def restore(self, packer, documents: dict) -> None:
        """Rebuild the packer's buffer in arrival order and restore its counters. documents:
        {key: (doc, overlap)}, each buffered document read and tokenized again (once, however many
        of its pieces are buffered)."""
        if not self.resumed:
            return
        keys, starts = self.buffered()
        for i, (key, start) in enumerate(zip(keys, starts)):
            doc, overlap = documents[key]
            if start is not None and start >= len(doc):
                raise ValueError(f"{self.state_name}['pieces'] starts buffered entry {i} at token "
                                 f"{start}, but its document has {len(doc)}: the state does not "
                                 "match the data or the tokenizer")
            packer.add(doc, key, overlap, start)
        if self.kind == "concat" and keys:
            offset, first = self.resumed["offset"], len(documents[keys[0]][0]) - (starts[0] or 0)
            # the first entry's last token is the next batch's first: never consumed
            if offset >= first:
                raise ValueError(f"{self.state_name}['offset'] is {offset}, but the first buffered "
                                 f"entry has {first} tokens: the state does not match the data or "
                                 "the tokenizer")
            packer.skip_consumed(offset)
        for name, value in self.resumed["counters"].items():  # names checked: check_fields
            setattr(packer, name, value)

    def state(self, packer, progress: Progress, tokens: np.ndarray) -> dict:
        """The state after a batch of `tokens`: where the walk goes on, what the packer buffers."""
        self.batches += 1
        self.tokens += tokens.size
        self.hash = hash_tokens(self.hash, tokens)
        units, cursor = progress.plan, progress.cursor
        pq_idx, rg_idx, epoch = progress.position
        counters = {name: getattr(packer, name) for name in packer.COUNTERS}
        keys = packer.buffered_keys()
        if self.watch is not None:  # the file the walk goes on in: its plan's first, else `next`
            # (a Cursor: a streaming walk is never shuffled, options.check_stream)
            at = (units[0].epoch, units[0].pq_idx) if units else (cursor.epoch, cursor.pq_idx)
            self.watch(keys, at)
        return add_checksum({
            "version": VERSION, "loader": self.kind,
            "pq_idx": pq_idx, "rg_idx": rg_idx, "epoch": epoch,
            "plan": self._plan_items(units) if units else [], "next": list(cursor),
            "buffer": self._encode_keys(keys), "pieces": packer.buffered_pieces(),
            "offset": packer.offset if self.kind == "concat" else 0,
            "config": self.config,
            "emitted": {"batches": self.batches, "tokens": self.tokens, "hash": self.hash},
            "counters": counters,
        })

    def _plan_items(self, units: list[PlanUnit]) -> list[dict]:
        # the encoded tail of a long plan changes only when a unit is finished or begun (a shuffled
        # plan lists a begun unit first, the others in file order): cache it
        first = units[0]
        key = (len(units), (first.epoch, first.pq_idx, first.rg_idx), first.doc_indices is None)
        if self._plan_cache[0] != key:
            self._plan_cache = (key, encode_plan(units[1:], self.index))
        return encode_plan(units[:1], self.index) + self._plan_cache[1]


# -----------------------------------------------------------------------------
# The units a state counts in: a global index over the split's files, read lazily


class UnitIndex:
    """The units a walk deals out, per file: parquet row groups, or chunks of `chunk_size` entries
    of a pretokenized shard (chunk_size set). Counted lazily by read_sizes(path) (the reader's: a
    parquet footer, an .idx header) when a file is first asked about; only plans and shuffled walks
    need them all (their global index). known_sizes: each file's, for the shards a streaming loader
    has not fetched yet, which have no footer to read."""

    def __init__(self, paths: list[str], read_sizes, chunk_size: int | None = None,
                 known_sizes: list[list[int]] | None = None):
        self.paths, self.read_sizes, self.chunk_size = paths, read_sizes, chunk_size
        # pq_idx -> documents in each of its units
        self._sizes: dict[int, list[int]] = (dict(enumerate(known_sizes))
                                             if known_sizes is not None else {})
        self._bases: list[int] | None = None  # cumulative counts: where each file starts

    def sizes(self, pq_idx: int) -> list[int]:
        """Documents in each unit of one file, read once."""
        if pq_idx not in self._sizes:
            self._sizes[pq_idx] = self.read_sizes(self.paths[pq_idx])
        return self._sizes[pq_idx]

    def count(self, pq_idx: int) -> int:
        return len(self.sizes(pq_idx))

    def docs(self, pq_idx: int, rg_idx: int) -> int:
        """Documents in one unit."""
        return self.sizes(pq_idx)[rg_idx]

    @property
    def bases(self) -> list[int]:
        if self._bases is None:  # reads every file's footer (or index)
            self._bases = [0]
            for pq_idx in range(len(self.paths)):
                self._bases.append(self._bases[-1] + self.count(pq_idx))
        return self._bases

    @property
    def total(self) -> int:
        return self.bases[-1]

    def base(self, pq_idx: int) -> int:
        return self.bases[pq_idx]

    def locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < self.total:
            raise ValueError("row group index past the end of the split")
        # bisect_right: past files with no units, which share their base with the next file
        pq_idx = bisect.bisect_right(self.bases, index) - 1
        return pq_idx, index - self.bases[pq_idx]


# -----------------------------------------------------------------------------
# Compact encodings


def encode_indices(indices) -> list[int]:
    """A unit's document indices, order kept, as a flat list: an index i, then -k when the k
    indices after it follow: [3, 4, 5, 9] -> [3, -2, 9]. One int for each lone index, the common
    case in a best-fit buffer."""
    out: list[int] = []
    previous = -2  # no index follows it: index 0 starts a run (-1 + 1 would continue one)
    for index in indices:
        if index == previous + 1:
            if out[-1] < 0:  # the run goes on
                out[-1] -= 1
            else:
                out.append(-1)
        else:
            out.append(index)
        previous = index
    return out


def decode_indices(runs) -> list[int]:
    indices: list[int] = []
    for value in runs:
        if value >= 0:
            indices.append(value)
        else:  # -k: the k indices after the last one
            indices.extend(range(indices[-1] + 1, indices[-1] + 1 - value))
    return indices


def encode_keys(keys) -> list[list]:
    """Document keys in order -> [[epoch, pq_idx, rg_idx, runs], ...]: consecutive keys of one unit
    grouped, their document indices as encode_indices writes them. A shuffled walk's documents
    are keyed by position, (epoch, window, i): they group as [epoch, window, runs]."""
    # groupby and itemgetter run in C: this runs once per batch over the whole buffer
    return [[*head, encode_indices(map(_last, group))]
            for head, group in itertools.groupby(keys, key=_head)]


def _head(key: tuple) -> tuple:
    return key[:-1]


_last = itemgetter(-1)


class KeyEncoder:
    """encode_keys for a buffer that changes a little every batch (a state's "buffer"): each key is
    numbered once, as one int (its head's number << 32 | its index), then the groups and runs of the
    whole buffer are found with numpy. The output is encode_keys' exactly; one pass over the keys
    in C instead of two in Python (~0.1 ms less at 1,000 keys)."""

    INDEX_LIMIT = 2**32  # indices below this fit under the head's number in the int64 code

    def __init__(self):
        self._codes = _Codes(self)  # key -> its code, computed on first sight
        self._head_ids: dict = {}  # head -> its number
        self._heads: list[list] = []  # number -> the head's fields, as encode_keys writes them

    def __call__(self, keys: list) -> list[list]:
        n = len(keys)
        if n == 0:
            return []
        if len(self._codes) > 4 * n + 4096:  # keys long gone: forget them all, stay bounded
            self._codes.clear(), self._head_ids.clear(), self._heads.clear()
        code = np.fromiter(map(self._codes.__getitem__, keys), dtype=np.int64, count=n)
        heads, indices = code >> 32, code & (self.INDEX_LIMIT - 1)
        # a group starts where the head changes; an index follows the one before it in its group
        new_group = np.ones(n, dtype=bool)
        np.not_equal(heads[1:], heads[:-1], out=new_group[1:])
        follows = np.zeros(n, dtype=bool)
        follows[1:] = (indices[1:] == indices[:-1] + 1) & ~new_group[1:]
        # encode_indices: an index that follows none is written; the k after it that follow, as -k
        starts = np.flatnonzero(~follows)
        run = np.empty(len(starts), dtype=np.int64)
        run[:-1] = starts[1:] - starts[:-1] - 1
        run[-1] = n - starts[-1] - 1
        has_run = run > 0
        at = np.arange(len(starts)) + np.cumsum(has_run) - has_run  # each start's place in `out`
        out = np.empty(len(starts) + int(np.count_nonzero(has_run)), dtype=np.int64)
        out[at] = indices[starts]
        out[at[has_run] + 1] = -run[has_run]
        firsts = np.flatnonzero(new_group[starts])  # the starts that begin a group
        bounds = at[firsts].tolist() + [len(out)]
        flat = out.tolist()
        return [[*self._heads[h], flat[a:b]]
                for h, a, b in zip(heads[starts[firsts]].tolist(), bounds, bounds[1:])]

    def code(self, key: tuple) -> int:
        head, index = key[:-1], key[-1]
        if not 0 <= index < self.INDEX_LIMIT:
            raise ValueError(f"document key {tuple(key)} has an index outside [0, 2**32)")
        number = self._head_ids.get(head)
        if number is None:
            number = self._head_ids[head] = len(self._heads)
            self._heads.append(list(head))
        return number << 32 | index


class _Codes(dict):
    """key -> KeyEncoder.code(key): a hit is one C-speed lookup, a miss computes and keeps it."""

    def __init__(self, encoder: KeyEncoder):
        super().__init__()
        self.encoder = encoder

    def __missing__(self, key) -> int:
        code = self[key] = self.encoder.code(key)
        return code


def decode_keys(groups) -> list:
    """[[epoch, pq_idx, rg_idx, runs], ...] -> DocKeys. A shuffled walk's groups of window entries,
    [epoch, window, runs] (three fields where a unit's have four), -> WindowKeys."""
    return [(WindowKey if len(group) == 3 else DocKey)(*group[:-1], index)
            for group in groups for index in decode_indices(group[-1])]


def decode_pieces(pieces, n: int) -> list:
    """"pieces" [[i, start], ...] (checked by check_fields) -> a list of n starts (None: a whole
    document)."""
    starts: list = [None] * n
    for i, start in pieces:
        starts[i] = start
    return starts


def encode_bitmap(indices, total: int) -> str:
    bits = np.zeros(total, dtype=np.uint8)
    bits[list(indices)] = 1
    # packbits: 8 units a byte, the first in the high bit, the last byte padded with zeros
    return base64.b64encode(np.packbits(bits).tobytes()).decode("ascii")


def decode_bitmap(text: str, total: int) -> list[int]:
    bits = np.unpackbits(np.frombuffer(base64.b64decode(text, validate=True), dtype=np.uint8))
    return np.flatnonzero(bits[:total]).tolist()  # [:total]: the padding is no unit


def encode_plan(units, index) -> list[dict]:
    """Units -> state items: a unit's listed documents stay a list; runs of whole row groups of one
    epoch become a bitmap."""
    items: list[dict] = []
    pending: list[int] = []  # global indices of whole row groups of pending_epoch
    pending_epoch = None

    def flush():
        if pending:
            items.append({"epoch": pending_epoch,
                          "row_groups": encode_bitmap(pending, index.total),
                          "total": index.total})
            pending.clear()

    for epoch, pq_idx, rg_idx, doc_indices, starts in units:
        if doc_indices is None:
            g = index.base(pq_idx) + rg_idx  # the row group's index across the split's files
            if pending and (epoch != pending_epoch or g <= pending[-1]):
                flush()  # a bitmap holds one epoch's row groups in file order
            pending_epoch = epoch
            pending.append(g)
        else:
            flush()  # an item of listed documents between whole row groups keeps the plan's order
            # the format's key "rows" holds the unit's document indices, as encode_indices writes
            item = {"epoch": epoch, "pq_idx": pq_idx, "rg_idx": rg_idx,
                    "rows": encode_indices(doc_indices)}
            if starts is not None and any(start is not None for start in starts):
                item["pieces"] = [[j, start] for j, start in enumerate(starts)
                                  if start is not None]
            items.append(item)
    flush()
    return items


def decode_plan(items, index) -> list[PlanUnit]:
    """State items (through check_fields and check_data) -> units."""
    units: list[PlanUnit] = []
    for item in items:
        if "row_groups" in item:
            groups = decode_bitmap(item["row_groups"], index.total)
            units += [PlanUnit(item["epoch"], *index.locate(g), None, None) for g in groups]
        else:
            doc_indices = tuple(decode_indices(item["rows"]))
            starts = (tuple(decode_pieces(item["pieces"], len(doc_indices))) if "pieces" in item
                      else None)
            units.append(PlanUnit(item["epoch"], item["pq_idx"], item["rg_idx"], doc_indices,
                                  starts))
    return units


# -----------------------------------------------------------------------------
# Fingerprints and checksums


def files_fingerprint(paths: list[str], sizes: list[int] | None = None) -> str:
    """Names and sizes of the split's files: a resume on other data is caught without reading
    them. sizes: theirs when they are not on disk yet (a streaming loader's catalog); the same
    fingerprint."""
    h = hashlib.sha256()
    for i, path in enumerate(paths):
        size = os.path.getsize(path) if sizes is None else sizes[i]
        # the base name: the same data in another directory has the same fingerprint
        h.update(f"{os.path.basename(path)}:{size}\n".encode())
    return h.hexdigest()[:32]


def tokenizer_fingerprint(tokenizer) -> str:
    """BOS, vocabulary size and the encoding of a probe text: re-tokenizing the buffered documents
    with another tokenizer would not give the same batches."""
    # words, punctuation, digits and non-ASCII letters: a change in any of them changes the ids
    probe = "Resume check: the quick brown fox, 1234567890, ünïcödé."
    bos = tokenizer.get_bos_token_id()
    vocab = tokenizer.get_vocab_size() if hasattr(tokenizer, "get_vocab_size") else None
    try:
        ids = [int(i) for i in tokenizer.encode([probe], prepend=bos, num_threads=1)[0]]
    except (TypeError, ValueError, IndexError):
        ids = None  # a broken tokenizer fails with a clear error at the first batch, not here
    return hashlib.sha256(json.dumps([bos, vocab, ids]).encode()).hexdigest()[:16]


def loader_config(loader: str, source: str, split: str, paths: list[str], *, B: int, T: int,
                  buffer_size: int | None, batch_size: int, tokenizer: str, rank: int,
                  world_size: int, chunk_size: int | None = None,
                  policy: tuple[str, int] | None = None, shuffle=None,
                  sizes: list[int] | None = None) -> dict:
    """The "config" a loader's states record: what they were taken on (docs/resume.md).
    shuffle: a nanochat.data.base.shuffle.Shuffle, recorded only when there is one. sizes: the
    files' sizes, when they are not all on disk (streaming)."""
    config = {"loader": loader, "source": source, "split": split,
              "files": files_fingerprint(paths, sizes), "num_files": len(paths)}
    if chunk_size is not None:  # the pretokenized loader's unit
        config["chunk_size"] = chunk_size
    config |= {"B": B, "T": T, "buffer_size": buffer_size, "tokenizer_batch_size": batch_size,
               "tokenizer": tokenizer, "rank": rank, "world_size": world_size}
    if policy is not None:
        config["long_doc_policy"], config["split_overlap"] = policy
    if shuffle is not None:  # its presence marks a shuffled walk: state_checks reads `next` by it
        config["shuffle"] = {"seed": shuffle.seed, "window": shuffle.window} | (
            {"bucket": shuffle.name} if shuffle.name else {})
    return config


def checksum(state: dict) -> str:
    body = {k: v for k, v in state.items() if k != "checksum"}
    # sorted keys, no spaces: the same digest whatever order the fields were written in
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def add_checksum(state: dict) -> dict:
    state["checksum"] = checksum(state)
    return state


def checksum_matches(state: dict, state_name: str, digest=checksum) -> bool:
    """Whether a state's "checksum" matches its contents (digest: how it is computed). A ValueError
    when it has none, or holds something JSON cannot write: no loader writes such a state."""
    if "checksum" not in state:
        raise ValueError(f"{state_name} is missing 'checksum' (a truncated state?)")
    try:
        return state["checksum"] == digest(state)
    except (TypeError, ValueError) as e:  # json.dumps: a type it cannot write, a cycle
        raise ValueError(f"{state_name} is not plain data ({e}): not a loader state") from None


def hash_tokens(previous: str, tokens: np.ndarray) -> str:
    """The running fingerprint of emitted tokens: sha256(previous digest, the tokens as uint32 LE),
    truncated to 128 bits. ~0.15 ms per 32x2049 batch (hashlib releases the GIL while it
    hashes)."""
    h = hashlib.sha256(bytes.fromhex(previous))
    # one fixed byte form, whatever the batch's dtype or byte order, so that hashes compare
    h.update(memoryview(np.ascontiguousarray(tokens, dtype="<u4")).cast("B"))
    return h.hexdigest()[:32]

"""
Loader states for exact and elastic resume: their format, their checks, and merging the states of
N ranks into the start of M ranks.

A state (version 2) is plain data: it survives json.dumps/json.loads and torch.save/torch.load(
weights_only=True). It refers to documents by where they were read, never by their tokens, so it
stays a few KB at buffer_size=1000 (the buffered documents are re-read and re-tokenized on resume):

    {
      "version": 2,
      "loader": "bestfit" | "concat",
      "pq_idx": 3, "rg_idx": 40, "epoch": 1,   # the seeds' keys: the last document batch consumed
      "plan": [item, ...],       # work left before the regular stream (only after an elastic merge)
      "next": [epoch, pq_idx, rg_idx, row],    # where the regular stream continues
      "buffer": [[epoch, pq_idx, rg_idx, rows], ...],  # buffered documents, arrival order
                                 # rows: [3, -2, 9] = rows 3, 4, 5 and 9 (-k: the k rows after)
      "pieces": [[i, start], ...],  # buffer entries i that are one piece of their document, from
                                 # token `start` (long_doc_policy "split"/"split_reuse"; concat: the
                                 # rest of a document an elastic merge dealt; else empty)
      "offset": 0,               # concat: tokens of the first buffered entry already consumed (each
                                 # batch consumes B*T: its last target is the next one's first input)
      "config": {...},           # what it was taken on: files, split, B, T, buffer_size, rank, ...
      "emitted": {"batches": k, "tokens": n, "hash": "..."},   # running sha256 of every token emitted
      "counters": {...},         # the loader's running statistics, so they continue after a resume
      "checksum": "...",         # sha256 of the rest: a truncated or hand-edited state is refused
    }
    item = {"epoch": e, "pq_idx": p, "rg_idx": g, "rows": rows[, "pieces": [[j, start], ...]]}
                                 # some rows of a row group (j: an index into rows, as in "pieces")
         | {"epoch": e, "row_groups": "<base64 bitmap over the split's row groups>", "total": n}

The regular stream of rank r of W reads, per epoch, row groups r, r+W, ... of every file (the seeds'
sharding), each cut into batches of tokenizer_batch_size documents. `next` is always the start of a
document batch, so a resumed loader cuts the same batches.

Elastic resume: `merge_states(states, world_size)` takes the states of all N ranks at one step and
returns {"version": 2, "merged": ..., "states": [one per new rank]}. Every document not yet trained on
(still buffered, the unread rest of a row group, or a row group not yet read in the current epoch) is
dealt round-robin to exactly one new rank as its plan; after its plan, new rank q continues with the
next epoch as rank q of M. The discarded tail of a cropped document counts as consumed. A buffered
piece of a split document is dealt as that piece alone, and so is the unconsumed rest of a document
the concatenating loader had started (from its first token not yet consumed: the last target of the
last batch, if it fell there), so that loader skips no token across an elastic restart either.

A state without "pieces" (or a config without "long_doc_policy") is read as "crop": states saved before
the policies existed resume unchanged. Every field of a state is checked before it is used (check_fields,
check_data): anything a loader would not have written is a ValueError naming the field.
"""

import base64
import binascii
import bisect
import hashlib
import itertools
import json
import logging
import os
import re
import reprlib
from operator import itemgetter

import numpy as np

from nanochat.dataset import open_parquet
from nanochat.packing import POLICIES, BestFitPacker, ConcatPacker

logger = logging.getLogger(__name__)

VERSION = 2
EMPTY_HASH = "0" * 32
Key = tuple  # (epoch, pq_idx, rg_idx, row): one document; (..., row, start): one piece of it
# (epoch, pq_idx, rg_idx, rows, starts): some work. rows: a tuple, or None for the whole row group;
# starts: None, or a tuple aligned with rows: None for a whole document, else the piece's start
Unit = tuple

# -----------------------------------------------------------------------------
# Compact encodings


def encode_rows(rows) -> list[int]:
    """Rows, order kept, as a flat list: a row r, then -k when the k rows after it follow:
    [3, 4, 5, 9] -> [3, -2, 9]. One int for each lone row, the common case in a best-fit buffer."""
    out: list[int] = []
    previous = -2
    for row in rows:
        if row == previous + 1:
            if out[-1] < 0:
                out[-1] -= 1
            else:
                out.append(-1)
        else:
            out.append(row)
        previous = row
    return out


def decode_rows(runs) -> list[int]:
    rows: list[int] = []
    for value in runs:
        if value >= 0:
            rows.append(value)
        else:
            rows.extend(range(rows[-1] + 1, rows[-1] + 1 - value))
    return rows


def encode_keys(keys) -> list[list]:
    """Document keys in order -> [[epoch, pq_idx, rg_idx, rows], ...]: consecutive keys of one unit
    grouped, their rows as encode_rows writes them (~0.15 ms per batch for a 1,000-document buffer)."""
    return [[*unit, encode_rows(map(_ROW, group))] for unit, group in itertools.groupby(keys, key=_UNIT)]


_UNIT, _ROW = itemgetter(0, 1, 2), itemgetter(3)


def decode_keys(groups) -> list[Key]:
    return [(epoch, pq_idx, rg_idx, row) for epoch, pq_idx, rg_idx, runs in groups for row in decode_rows(runs)]


def decode_pieces(pieces, n: int) -> list:
    """"pieces" [[i, start], ...] (checked by check_fields) -> a list of n starts (None: a whole document)."""
    starts: list = [None] * n
    for i, start in pieces:
        starts[i] = start
    return starts


def encode_bitmap(indices, total: int) -> str:
    bits = np.zeros(total, dtype=np.uint8)
    bits[list(indices)] = 1
    return base64.b64encode(np.packbits(bits).tobytes()).decode("ascii")


def decode_bitmap(text: str, total: int) -> list[int]:
    bits = np.unpackbits(np.frombuffer(base64.b64decode(text, validate=True), dtype=np.uint8))
    return np.flatnonzero(bits[:total]).tolist()


# -----------------------------------------------------------------------------
# Where row groups are: a global index over the split's files, read lazily (footers only)


class RowGroupIndex:
    """The units a stream deals out, per file: parquet row groups, or chunks of `chunk_size` entries
    of a pretokenized shard (chunk_size set). Counted lazily, a file's footer or index when that
    file is first asked about; only a plan's bitmaps (after an elastic merge) need them all."""

    def __init__(self, paths: list[str], chunk_size: int | None = None):
        self.paths = paths
        self.chunk_size = chunk_size
        self._sizes: dict[int, list[int]] = {}  # pq_idx -> documents in each of its units
        self._bases: list[int] | None = None  # cumulative counts: where each file starts

    def sizes(self, pq_idx: int) -> list[int]:
        """Documents in each unit of one file, from its footer (or its index), read once."""
        if pq_idx not in self._sizes:
            if self.chunk_size is None:
                meta = open_parquet(self.paths[pq_idx]).metadata
                self._sizes[pq_idx] = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            else:
                from nanochat.pretokenize import TokenShard
                n = len(TokenShard(self.paths[pq_idx]))
                self._sizes[pq_idx] = [min(self.chunk_size, n - start) for start in range(0, n, self.chunk_size)]
        return self._sizes[pq_idx]

    def count(self, pq_idx: int) -> int:
        return len(self.sizes(pq_idx))

    def rows(self, pq_idx: int, rg_idx: int) -> int:
        """Documents in one unit."""
        return self.sizes(pq_idx)[rg_idx]

    @property
    def bases(self) -> list[int]:
        if self._bases is None:
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
        pq_idx = bisect.bisect_right(self.bases, index) - 1
        return pq_idx, index - self.bases[pq_idx]


def encode_plan(units, index: RowGroupIndex) -> list[dict]:
    """Units -> state items: explicit rows stay rows; runs of whole row groups of one epoch become a bitmap."""
    items: list[dict] = []
    pending: list[int] = []  # global indices of whole row groups of pending_epoch
    pending_epoch = None

    def flush():
        if pending:
            items.append({"epoch": pending_epoch, "row_groups": encode_bitmap(pending, index.total),
                          "total": index.total})
            pending.clear()

    for epoch, pq_idx, rg_idx, rows, starts in units:
        if rows is None:
            g = index.base(pq_idx) + rg_idx
            if pending and (epoch != pending_epoch or g <= pending[-1]):
                flush()  # a bitmap holds one epoch's row groups in file order
            pending_epoch = epoch
            pending.append(g)
        else:
            flush()
            item = {"epoch": epoch, "pq_idx": pq_idx, "rg_idx": rg_idx, "rows": encode_rows(rows)}
            if starts is not None and any(start is not None for start in starts):
                item["pieces"] = [[j, start] for j, start in enumerate(starts) if start is not None]
            items.append(item)
    flush()
    return items


def decode_plan(items, index: RowGroupIndex) -> list[Unit]:
    """State items (through check_fields and check_data) -> units."""
    units: list[Unit] = []
    for item in items:
        if "row_groups" in item:
            groups = decode_bitmap(item["row_groups"], index.total)
            units += [(item["epoch"], *index.locate(g), None, None) for g in groups]
        else:
            rows = tuple(decode_rows(item["rows"]))
            starts = tuple(decode_pieces(item["pieces"], len(rows))) if "pieces" in item else None
            units.append((item["epoch"], item["pq_idx"], item["rg_idx"], rows, starts))
    return units


# -----------------------------------------------------------------------------
# Fingerprints and checksums


def files_fingerprint(paths: list[str]) -> str:
    """Names and sizes of the split's files: a resume on other data is caught without reading them."""
    h = hashlib.sha256()
    for path in paths:
        h.update(f"{os.path.basename(path)}:{os.path.getsize(path)}\n".encode())
    return h.hexdigest()[:32]


def tokenizer_fingerprint(tokenizer) -> str:
    """BOS, vocabulary size and the encoding of a probe text: re-tokenizing the buffered documents with
    another tokenizer would not give the same batches."""
    probe = "Resume check: the quick brown fox, 1234567890, ünïcödé."
    bos = tokenizer.get_bos_token_id()
    vocab = tokenizer.get_vocab_size() if hasattr(tokenizer, "get_vocab_size") else None
    try:
        ids = [int(i) for i in tokenizer.encode([probe], prepend=bos, num_threads=1)[0]]
    except (TypeError, ValueError, IndexError):
        ids = None  # a broken tokenizer fails with a clear error at the first batch, not here
    return hashlib.sha256(json.dumps([bos, vocab, ids]).encode()).hexdigest()[:16]


def checksum(state: dict) -> str:
    body = {k: v for k, v in state.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def seal(state: dict) -> dict:
    state["checksum"] = checksum(state)
    return state


def intact(state: dict, where: str, digest=checksum) -> bool:
    """Whether a state's "checksum" matches its contents (digest: how it is computed). A ValueError when it
    has none, or holds something JSON cannot write: no loader writes such a state."""
    if "checksum" not in state:
        raise ValueError(f"{where} is missing 'checksum' (a truncated state?)")
    try:
        return state["checksum"] == digest(state)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} is not plain data ({e}): not a loader state") from None


def hash_tokens(previous: str, tokens: np.ndarray) -> str:
    """The running fingerprint of emitted tokens: sha256(previous digest, the tokens as uint32 LE),
    truncated to 128 bits. ~0.15 ms per 32x2049 batch (hashlib releases the GIL while it hashes)."""
    h = hashlib.sha256(bytes.fromhex(previous))
    h.update(memoryview(np.ascontiguousarray(tokens, dtype="<u4")).cast("B"))
    return h.hexdigest()[:32]


# -----------------------------------------------------------------------------
# Checking a state, field by field
#
# A state can come from anywhere (a checkpoint, a hand edit resealed with seal(), allow_state_mismatch=True),
# so every field is checked before it is used: its shape and values (check_fields, from the state alone),
# then, when the state continues this stream, its places in the data (check_data). Run-length rows and
# bitmaps are measured before they are decoded, so a state cannot make a loader allocate more than its
# buffer and the data's row groups hold. Errors are ValueErrors that name the field.

REQUIRED = ("version", "loader", "pq_idx", "rg_idx", "epoch", "plan", "next", "buffer", "offset", "config",
            "emitted", "counters", "checksum")
# config fields that change which documents a rank reads, in which order: a state taken with other
# values cannot continue the same stream
STREAM_FIELDS = ("loader", "source", "split", "files", "num_files", "chunk_size", "rank", "world_size")
# the config of every version-2 state has these; the later ones came with the pretokenized loader and the policies
CONFIG_FIELDS = ("loader", "split", "files", "num_files", "B", "T", "buffer_size", "tokenizer_batch_size",
                 "tokenizer", "rank", "world_size")
LATER_CONFIG_FIELDS = ("source", "chunk_size", "long_doc_policy", "split_overlap")
COUNTERS = {"bestfit": BestFitPacker.COUNTERS, "concat": ConcatPacker.COUNTERS}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value, where: str, low: int = 0) -> int:
    if not _is_int(value) or value < low:
        raise ValueError(f"{where} must be an int >= {low}, got {reprlib.repr(value)}")
    return value


def _hex(value, where: str, n: int = 32) -> None:
    if not (isinstance(value, str) and re.fullmatch(f"[0-9a-f]{{{n}}}", value)):
        raise ValueError(f"{where} must be {n} lowercase hex digits (a sha256 prefix), got {reprlib.repr(value)}")


def _list(value, where: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list, got {type(value).__name__}")
    return value


def _fields(value, where: str, required, optional=None) -> dict:
    """value, if it is a dict with every required key and no other than the optional ones (None: any)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a dict, got {type(value).__name__}")
    for key in required:
        if key not in value:
            raise ValueError(f"{where} is missing {key!r} (a truncated state?)")
    for key in value if optional is not None else ():
        if key not in required and key not in optional:
            raise ValueError(f"{where} has an unknown field {reprlib.repr(key)}")
    return value


def _runs(runs, where: str) -> tuple[int, int]:
    """(how many rows, the largest) of encode_rows' output, measured without decoding it."""
    if not (isinstance(runs, list) and runs and all(_is_int(v) for v in runs) and runs[0] >= 0):
        raise ValueError(f"{where} must be a non-empty list of rows (ints >= 0, a row followed by -k: the k rows "
                         f"after it too), got {reprlib.repr(runs)}")
    count = row = largest = 0
    for value in runs:
        row, count = (value, count + 1) if value >= 0 else (row - value, count - value)
        largest = max(largest, row)
    return count, largest


def _pieces(pieces, n: int, where: str) -> int:
    """Check [[i, start], ...] (indices into n entries, increasing; starts >= 0); returns how many."""
    previous = -1
    for pair in _list(pieces, where):
        if not (isinstance(pair, list) and len(pair) == 2 and all(_is_int(v) for v in pair)
                and previous < pair[0] < n and pair[1] >= 0):
            raise ValueError(f"{where}: {reprlib.repr(pair)} is not [index, start] (indices increasing, below {n}; "
                             "start >= 0)")
        previous = pair[0]
    return len(pieces)


def _bitmap(text, total: int, where: str) -> None:
    size = (total + 7) // 8 * 8  # bits: the bitmap is padded with zeros to whole bytes
    if isinstance(text, str) and len(text) == -(-size // 24) * 4:  # base64: 4 characters per 3 bytes
        try:
            bits = np.unpackbits(np.frombuffer(base64.b64decode(text, validate=True), dtype=np.uint8))
            if len(bits) == size and not bits[total:].any():
                return
        except binascii.Error:
            pass
    raise ValueError(f"{where} must be the base64 bitmap of {total} row groups, got {reprlib.repr(text)}")


def _check_config(config, loader: str, where: str) -> dict:
    _fields(config, where, CONFIG_FIELDS, LATER_CONFIG_FIELDS)
    if config["loader"] != loader:
        raise ValueError(f"{where}['loader'] is {reprlib.repr(config['loader'])}, but the state is a {loader!r} state")
    if config.get("source", "parquet") not in ("parquet", "pretokenized"):
        raise ValueError(f"{where}['source'] must be 'parquet' or 'pretokenized', got {reprlib.repr(config['source'])}")
    for key in ("split", "tokenizer"):
        if not isinstance(config[key], str):
            raise ValueError(f"{where}[{key!r}] must be a str, got {reprlib.repr(config[key])}")
    _hex(config["files"], f"{where}['files']")
    for key in ("num_files", "B", "T", "tokenizer_batch_size", "world_size", "chunk_size"):
        if key in config:
            _int(config[key], f"{where}[{key!r}]", 1)
    if loader == "bestfit":
        _int(config["buffer_size"], f"{where}['buffer_size']", 1)
    elif config["buffer_size"] is not None:
        raise ValueError(f"{where}['buffer_size'] must be None (the concatenating loader has no buffer size), got "
                         f"{reprlib.repr(config['buffer_size'])}")
    if _int(config["rank"], f"{where}['rank']") >= config["world_size"]:
        raise ValueError(f"{where}['rank'] is {config['rank']}, but world_size is {config['world_size']}")
    policy, overlap = config.get("long_doc_policy", "crop"), config.get("split_overlap", 0)
    if policy not in POLICIES:
        raise ValueError(f"{where}['long_doc_policy'] must be one of {POLICIES}, got {reprlib.repr(policy)}")
    if not (_is_int(overlap) and 0 <= overlap < config["T"]) or (overlap and policy == "crop"):
        raise ValueError(f"{where}['split_overlap'] must be an int in [0, T-1] (0 under 'crop'), got "
                         f"{reprlib.repr(overlap)}")
    return config


def _check_emitted(emitted, where: str) -> None:
    _fields(emitted, where, ("batches", "tokens", "hash"), ())
    _int(emitted["batches"], f"{where}['batches']")
    _int(emitted["tokens"], f"{where}['tokens']")
    _hex(emitted["hash"], f"{where}['hash']")


def buffer_limit(config: dict, loader: str) -> int:
    """The most whole documents a loader keeps buffered after a batch (its pieces come on top): best-fit refills
    while it holds fewer than buffer_size (a mixture's bucket: fewer than a row's T+1 tokens), a tokenizer batch at
    a time; concatenation while it holds fewer than the batch's B*T+1 tokens, each document at least one."""
    if loader == "bestfit":
        return max(config["buffer_size"], config["T"] + 1) + config["tokenizer_batch_size"]
    return config["B"] * config["T"] + config["tokenizer_batch_size"]


def check_fields(state: dict, where: str = "resume_state_dict", loader_config: dict | None = None) -> None:
    """Check every field of a version-2 loader state on its own (check_data checks it against the data).
    loader_config: the config of the loader resuming from it, whose buffer it may fill too."""
    _fields(state, where, REQUIRED, ("pieces",))
    if state["version"] != VERSION:
        raise ValueError(f"{where}['version'] is {reprlib.repr(state['version'])}; this loader reads version {VERSION}")
    loader = state["loader"]
    if not isinstance(loader, str) or loader not in COUNTERS:
        raise ValueError(f"{where}['loader'] must be 'bestfit' or 'concat', got {reprlib.repr(loader)}")
    _int(state["pq_idx"], f"{where}['pq_idx']")
    _int(state["rg_idx"], f"{where}['rg_idx']")
    _int(state["epoch"], f"{where}['epoch']", 1)  # epochs count from 1
    _hex(state["checksum"], f"{where}['checksum']")
    config = _check_config(state["config"], loader, f"{where}['config']")
    _check_emitted(state["emitted"], f"{where}['emitted']")
    counters = _fields(state["counters"], f"{where}['counters']", ())  # no counter is required: they start at 0
    for name, value in counters.items():
        if name not in COUNTERS[loader]:
            raise ValueError(f"{where}['counters'] has an unknown counter {reprlib.repr(name)} (a {loader} "
                             f"loader's are {', '.join(COUNTERS[loader])})")
        _int(value, f"{where}['counters'][{name!r}]")
    cursor = _list(state["next"], f"{where}['next']")
    if len(cursor) != 4 or not all(_is_int(v) and v >= 0 for v in cursor) or cursor[0] < 1:
        raise ValueError(f"{where}['next'] must be [epoch >= 1, pq_idx, rg_idx, row] (ints >= 0), got "
                         f"{reprlib.repr(cursor)}")

    # the buffer: [[epoch, pq_idx, rg_idx, rows], ...], its pieces, and (concat) the consumed start of its first
    buffered = 0
    for i, group in enumerate(_list(state["buffer"], f"{where}['buffer']")):
        if not (isinstance(group, list) and len(group) == 4 and all(_is_int(v) and v >= 0 for v in group[:3])
                and group[0] >= 1):
            raise ValueError(f"{where}['buffer'][{i}] must be [epoch >= 1, pq_idx, rg_idx, rows], got "
                             f"{reprlib.repr(group)}")
        buffered += _runs(group[3], f"{where}['buffer'][{i}]")[0]
    pieces = _pieces(state.get("pieces", []), buffered, f"{where}['pieces']")
    limit = buffer_limit(config, loader)
    if loader_config is not None and loader_config["loader"] == loader:
        # a loader resumed (allow_state_mismatch) from a state with a larger buffer drains it: a loader as large
        # can resume the states it yields meanwhile
        limit = max(limit, buffer_limit(loader_config, loader))
    if buffered - pieces > limit:
        raise ValueError(f"{where}['buffer'] holds {buffered - pieces} whole documents, more than the {limit} a "
                         f"{loader} loader with this config keeps (a loader that keeps as many can resume it, "
                         "with allow_state_mismatch=True)")
    offset = _int(state["offset"], f"{where}['offset']")
    if offset and (loader == "bestfit" or not buffered):
        raise ValueError(f"{where}['offset'] must be 0 " + ("for a best-fit state" if loader == "bestfit" else
                                                            "when the buffer is empty") + f", got {offset}")

    # the plan: items of explicit rows (and their pieces), or bitmaps of whole row groups
    for i, item in enumerate(_list(state["plan"], f"{where}['plan']")):
        at = f"{where}['plan'][{i}]"
        if isinstance(item, dict) and "row_groups" in item:
            _fields(item, at, ("epoch", "row_groups", "total"), ())
            _bitmap(item["row_groups"], _int(item["total"], f"{at}['total']", 1), f"{at}['row_groups']")
        else:
            _fields(item, at, ("epoch", "pq_idx", "rg_idx", "rows"), ("pieces",))
            _int(item["pq_idx"], f"{at}['pq_idx']")
            _int(item["rg_idx"], f"{at}['rg_idx']")
            _pieces(item.get("pieces", []), _runs(item["rows"], f"{at}['rows']")[0], f"{at}['pieces']")
        _int(item["epoch"], f"{at}['epoch']", 1)


def check_data(state: dict, index: RowGroupIndex, where: str = "resume_state_dict") -> None:
    """Check that every place a state (through check_fields) refers to is in the data: its files, their row
    groups (or chunks) and rows; and that `next` is in the share of the state's rank."""
    unit = "row group" if index.chunk_size is None else "chunk"
    files = len(index.paths)

    def rows_in(pq_idx: int, rg_idx: int, runs, at: str) -> int:
        """How many rows `runs` lists, checked to be rows of that unit."""
        if pq_idx >= files or rg_idx >= index.count(pq_idx):
            raise ValueError(f"{at} refers to file {pq_idx}, {unit} {rg_idx}, which the data does not have (it has "
                             f"{files} files): the state does not match the data")
        count, largest = _runs(runs, at)
        n = index.rows(pq_idx, rg_idx)
        if largest >= n:
            raise ValueError(f"{at} refers to row {largest} of {os.path.basename(index.paths[pq_idx])} {unit} "
                             f"{rg_idx}, which has {n} rows: the state does not match the data")
        return count

    pq_idx, rg_idx = state["pq_idx"], state["rg_idx"]
    if pq_idx >= files or (rg_idx > 0 and rg_idx >= index.count(pq_idx)):  # (0, 0): before the first batch
        raise ValueError(f"{where}['pq_idx'], ['rg_idx'] = {pq_idx}, {rg_idx}: a {unit} the data does not have "
                         f"({files} files)")
    rank, world_size = state["config"]["rank"], state["config"]["world_size"]
    _, pq_idx, rg_idx, row = state["next"]
    # the regular stream continues at one of this rank's units (rank, rank + world_size, ...), or just past a file's
    # last one; at a row of it only if that row exists
    if not (pq_idx < files and rg_idx % world_size == rank and rg_idx < index.count(pq_idx) + world_size
            and (row == 0 or (rg_idx < index.count(pq_idx) and row < index.rows(pq_idx, rg_idx)))):
        raise ValueError(f"{where}['next'] = {state['next']} is not a place where rank {rank} of {world_size} reads "
                         f"(the data has {files} files): the state does not match the data")
    for i, (_, pq_idx, rg_idx, runs) in enumerate(state["buffer"]):
        rows_in(pq_idx, rg_idx, runs, f"{where}['buffer'][{i}]")
    for i, item in enumerate(state["plan"]):
        at = f"{where}['plan'][{i}]"
        if "row_groups" in item:
            if item["total"] != index.total:
                raise ValueError(f"{at}['total'] is {item['total']}, but the data has {index.total} {unit}s")
        else:
            whole = rows_in(item["pq_idx"], item["rg_idx"], item["rows"], f"{at}['rows']") - len(item.get("pieces", []))
            if whole > index.rows(item["pq_idx"], item["rg_idx"]):
                raise ValueError(f"{at}['rows'] lists {whole} whole documents of a {unit} that has "
                                 f"{index.rows(item['pq_idx'], item['rg_idx'])}")


def rank_state(merged: dict, rank: int, world_size: int, where: str = "resume_state_dict") -> tuple[dict, str]:
    """This rank's part of merge_states' result (every new rank is given all of it), and what messages call it."""
    _fields(merged, where, ("version", "merged", "states"), ())
    if merged["version"] != VERSION:
        raise ValueError(f"{where}['version'] is {reprlib.repr(merged['version'])}; this loader reads "
                         f"version {VERSION}")
    info, states = merged["merged"], _list(merged["states"], f"{where}['states']")
    _fields(info, f"{where}['merged']", ("from_world_size", "world_size"), ())
    _int(info["from_world_size"], f"{where}['merged']['from_world_size']", 1)
    if info["world_size"] != len(states):
        raise ValueError(f"{where}['merged']['world_size'] is {reprlib.repr(info['world_size'])}, but it holds "
                         f"{len(states)} states")
    if len(states) != world_size:
        raise ValueError(f"{where}['merged'] is for {len(states)} ranks, but this run has world size {world_size}; "
                         "merge for this world size")
    return _fields(states[rank], f"{where}['states'][{rank}]", ()), f"{where}['states'][{rank}]"


def check_state(state: dict, config: dict, index: RowGroupIndex, *, allow_mismatch: bool,
                where: str = "resume_state_dict") -> bool:
    """Validate a version-2 state against this loader's config and data. Returns True when the state continues
    this loader's stream exactly (or, with allow_mismatch, at least the same document stream), False when only
    the seeds' approximate keys can be used (another rank's state, or allow_mismatch and another stream)."""
    if state.get("version") != VERSION:
        raise ValueError(f"{where}['version'] is {reprlib.repr(state.get('version'))}; this loader reads "
                         f"version {VERSION} (and the seeds' {{pq_idx, rg_idx, epoch}} form)")
    _fields(state, where, REQUIRED, ("pieces",))
    if not intact(state, where) and not allow_mismatch:
        raise ValueError(f"{where}['checksum'] does not match its contents: the state was edited or corrupted; "
                         "pass allow_state_mismatch=True to resume from it anyway")
    check_fields(state, where, config)
    saved = dict(state["config"])
    if state["loader"] == "bestfit":  # saved before the long-document policies: the seeds' cropping
        saved = {"long_doc_policy": "crop", "split_overlap": 0} | saved
    differ = [f"{k}: state {saved.get(k)!r}, loader {v!r}" for k, v in config.items() if saved.get(k) != v]
    if differ and not allow_mismatch and {k for k, v in config.items() if saved.get(k) != v} <= {"rank", "world_size"}:
        # nanochat's base_train saves rank 0's state alone and hands it to every rank on resume: such a
        # rank resumes approximately, after the saved row group, exactly as nanochat's own loader does
        logger.warning("%s is another rank's state (%s): resuming approximately after its "
                       "file %s, unit %s, as nanochat does; for an exact resume give each rank its own state "
                       "(merge_states for another world size)", where, "; ".join(differ), state["pq_idx"],
                       state["rg_idx"])
        return False
    if differ and not allow_mismatch:
        raise ValueError(f"{where} was taken on another configuration (" + "; ".join(differ) +
                         "); pass allow_state_mismatch=True to resume as well as possible")
    exact = all(saved.get(k) == config.get(k) for k in STREAM_FIELDS)
    if exact:
        check_data(state, index, where)
    return exact


# -----------------------------------------------------------------------------
# Elastic resume: N states -> M ranks


def merge_states(states: list[dict], world_size: int, *, data_dir: str | None = None,
                 epochs: int | None = None) -> dict:
    """Merge the states of all N ranks, taken at the same step, into the resume state of M ranks.

    Each rank saves its own state with its checkpoint; to restart on M ranks, load all N, call
    merge_states(states, M), and give the result to every new rank as resume_state_dict (rank r of M
    picks its part). data_dir: where the shards are, as given to the loader (default: the dataset
    directory; for the pretokenized loader, its directory holding train/ and val/). Mixture states
    (nanochat/mixture.py) are merged too. epochs: the streams read their data this many times and then
    end (a mixture's buckets: once); nothing past it is dealt."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(states, (list, tuple)) or not states:
        raise ValueError("merge_states needs the list of every rank's state")
    if isinstance(states[0], dict) and states[0].get("loader") == "mixture":
        from nanochat.mixture import merge_mixture_states
        if data_dir is None:
            raise ValueError("data_dir: give the mixture's data directory (holding <split>/<bucket>/)")
        return merge_mixture_states(states, world_size, data_dir=data_dir)
    # the merge of one rank, given as that rank's state
    states = [s["states"][0] if isinstance(s, dict) and "merged" in s and isinstance(s.get("states"), list)
              and len(s["states"]) == 1 else s for s in states]
    return _merge_states(states, world_size, data_dir, epochs, [f"states[{i}]" for i in range(len(states))])


def _merge_states(states: list, world_size: int, data_dir: str | None, epochs: int | None, names: list[str]) -> dict:
    """merge_states of best-fit or concatenating states; names: what messages call each state."""
    from nanochat.dataset import split_parquet_files  # here: resume.py stays importable without the store

    for s, name in zip(states, names):
        if not isinstance(s, dict) or s.get("version") != VERSION:
            raise ValueError(f"{name} is not a version-{VERSION} loader state (field 'version')")
        if "merged" in s:
            raise ValueError(f"{name} is a merged state: give each rank's own state, not the merge")
        if not intact(s, name):
            raise ValueError(f"{name}['checksum'] does not match its contents (edited or corrupted)")
        check_fields(s, name)
    first = states[0]
    n_old = first["config"]["world_size"]
    if len(states) != n_old:
        raise ValueError(f"config.world_size: the states were taken on {n_old} ranks, but {len(states)} were given")
    for s, name in zip(states, names):
        for key in ("loader", "source", "split", "files", "num_files", "chunk_size", "B", "T", "buffer_size",
                    "tokenizer_batch_size", "tokenizer", "world_size", "long_doc_policy", "split_overlap"):
            if s["config"].get(key) != first["config"].get(key):
                raise ValueError(f"config.{key}: {name} has {s['config'].get(key)!r}, "
                                 f"{names[0]} has {first['config'].get(key)!r}")
        if s["emitted"]["batches"] != first["emitted"]["batches"]:
            raise ValueError(f"emitted.batches: {name} was taken after {s['emitted']['batches']} batches, "
                             f"{names[0]} after {first['emitted']['batches']}; merge states of one step")
    ranks = sorted(s["config"]["rank"] for s in states)
    if ranks != list(range(n_old)):
        raise ValueError(f"config.rank: need each of ranks 0..{n_old - 1} once, got {ranks}")
    chunk_size = first["config"].get("chunk_size")
    if chunk_size is None:
        paths = split_parquet_files(first["config"]["split"], data_dir)
    else:
        from nanochat.pretokenize import list_token_shards
        if data_dir is None:
            raise ValueError("data_dir: give the pretokenized directory the states were taken on")
        paths = [prefix + ".bin" for prefix in list_token_shards(os.path.join(data_dir, first["config"]["split"]))]
    if files_fingerprint(paths) != first["config"]["files"]:
        raise ValueError("config.files: the shards on disk are not the ones the states were taken on")
    index = RowGroupIndex(paths, chunk_size)
    low = min(s["next"][0] for s in states)
    for s, name in zip(states, names):
        check_data(s, index, name)
        # a rank reads at most one document per token it emits, plus its buffer: since its last restart (where all
        # ranks started at one epoch) it cannot have got further ahead of the others than that covers of its share.
        # (A `next` further ahead, hand-edited, would have this merge deal epoch after epoch for a very long time.)
        rank = s["config"]["rank"]
        share = sum(sum(index.sizes(p)[rank::n_old]) for p in range(len(paths)))
        if (s["next"][0] - low) * max(1, share) > s["emitted"]["tokens"] + buffer_limit(s["config"], s["loader"]):
            raise ValueError(f"{name}['next'] is in epoch {s['next'][0]}, {s['next'][0] - low} past another rank's, "
                             f"more than the {s['emitted']['tokens']} tokens it emitted can have read of its share "
                             f"({share} documents an epoch): not the states of one step")
    states = sorted(states, key=lambda s: s["config"]["rank"])

    # everything not yet trained on: explicit documents, then whole row groups per epoch
    docs: list[Key] = []
    whole: dict[int, set[int]] = {}
    for s in states:
        buffered = decode_keys(s["buffer"])
        starts = decode_pieces(s.get("pieces", []), len(buffered))
        buffered = [key if start is None else (*key, start) for key, start in zip(buffered, starts)]
        if s["loader"] == "concat" and s["offset"] > 0:  # partly consumed: deal the rest
            key = buffered[0]
            buffered[0] = (*key[:4], (key[4] if len(key) == 5 else 0) + s["offset"])
        docs += buffered
        for epoch, pq_idx, rg_idx, rows, starts in decode_plan(s["plan"], index):
            if rows is None:
                whole.setdefault(epoch, set()).add(index.base(pq_idx) + rg_idx)
            else:
                starts = starts or (None,) * len(rows)
                docs += [(epoch, pq_idx, rg_idx, r) if st is None else (epoch, pq_idx, rg_idx, r, st)
                         for r, st in zip(rows, starts)]
    last_epoch = max(s["next"][0] for s in states)
    if epochs is not None:
        last_epoch = min(last_epoch, epochs)  # a finished stream's cursor points past its last epoch
    for rank, s in enumerate(states):
        epoch, pq_idx, rg_idx, row = s["next"]
        # the rest of this rank's share of its current epoch, then all of its share of later ones
        for e in range(epoch, last_epoch + 1):
            for p in range(len(paths)):
                for g in range(rank, index.count(p), n_old):
                    if e == epoch and (p, g) < (pq_idx, rg_idx):
                        continue
                    if e == epoch and (p, g) == (pq_idx, rg_idx) and row > 0:
                        docs += [(e, p, g, r) for r in range(row, index.rows(p, g))]
                        continue
                    whole.setdefault(e, set()).add(index.base(p) + g)

    # deal: documents one by one, then row groups one by one, round-robin over the new ranks
    units: list[list[Unit]] = [[] for _ in range(world_size)]
    for i, key in enumerate(docs):
        units[i % world_size].append((*key[:3], (key[3],), None if len(key) == 4 else (key[4],)))
    dealt = 0
    for epoch in sorted(whole):
        for g in sorted(whole[epoch]):
            units[dealt % world_size].append((epoch, *index.locate(g), None, None))
            dealt += 1
    merged = []
    for q in range(world_size):
        plan = encode_plan(_coalesce(units[q]), index)
        config = dict(first["config"], rank=q, world_size=world_size)
        state = {"version": VERSION, "loader": first["loader"], "pq_idx": first["pq_idx"],
                 "rg_idx": first["rg_idx"], "epoch": first["epoch"], "plan": plan,
                 "next": [last_epoch + 1, 0, q, 0], "buffer": [], "pieces": [], "offset": 0, "config": config,
                 "emitted": {"batches": first["emitted"]["batches"], "tokens": 0, "hash": EMPTY_HASH},
                 "counters": {}}
        merged.append(seal(state))
    return {"version": VERSION, "merged": {"from_world_size": n_old, "world_size": world_size}, "states": merged}


def _coalesce(units: list[Unit]) -> list[Unit]:
    """Join consecutive single-document units of one row group (keeps a new rank's plan short)."""
    out: list[Unit] = []
    for unit in units:
        last = out[-1] if out else None
        if last and unit[3] is not None and last[3] is not None and last[:3] == unit[:3]:
            starts = None
            if last[4] is not None or unit[4] is not None:
                starts = (last[4] or (None,) * len(last[3])) + (unit[4] or (None,) * len(unit[3]))
            out[-1] = (*unit[:3], last[3] + unit[3], starts)
        else:
            out.append(unit)
    return out

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
the policies existed resume unchanged.
"""

import base64
import bisect
import hashlib
import itertools
import json
import logging
import os
from operator import itemgetter

import numpy as np

from nanochat.dataset import open_parquet

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


def decode_pieces(pieces, n: int, where: str) -> list:
    """"pieces" [[i, start], ...] -> a list of n starts (None where the entry is a whole document)."""
    starts: list = [None] * n
    if not isinstance(pieces, list):
        raise ValueError(f"{where} must be a list of [index, start] pairs")
    for pair in pieces:
        if not (isinstance(pair, list) and len(pair) == 2 and all(_is_int(v) for v in pair)
                and 0 <= pair[0] < n and pair[1] >= 0):
            raise ValueError(f"{where}: {pair!r} is not [index < {n}, start >= 0]")
        starts[pair[0]] = pair[1]
    return starts


def encode_bitmap(indices, total: int) -> str:
    bits = np.zeros(total, dtype=np.uint8)
    bits[list(indices)] = 1
    return base64.b64encode(np.packbits(bits).tobytes()).decode("ascii")


def decode_bitmap(text: str, total: int) -> list[int]:
    bits = np.unpackbits(np.frombuffer(base64.b64decode(text, validate=True), dtype=np.uint8))
    if len(bits) < total or bits[total:].any():
        raise ValueError("bitmap does not match the number of row groups")
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
        self._counts: dict[int, int] = {}
        self._bases: list[int] | None = None  # cumulative counts: where each file starts

    def _entries(self, pq_idx: int) -> int:
        from nanochat.pretokenize import TokenShard
        return len(TokenShard(self.paths[pq_idx]))

    def count(self, pq_idx: int) -> int:
        if pq_idx not in self._counts:
            if self.chunk_size is None:
                self._counts[pq_idx] = open_parquet(self.paths[pq_idx]).num_row_groups
            else:
                self._counts[pq_idx] = -(-self._entries(pq_idx) // self.chunk_size)
        return self._counts[pq_idx]

    def rows(self, pq_idx: int, rg_idx: int) -> int:
        """Documents in one unit."""
        if self.chunk_size is None:
            return open_parquet(self.paths[pq_idx]).metadata.row_group(rg_idx).num_rows
        return min(self.chunk_size, self._entries(pq_idx) - rg_idx * self.chunk_size)

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
    units: list[Unit] = []
    for i, item in enumerate(items):
        where = f"resume_state_dict['plan'][{i}]"
        if not isinstance(item, dict) or not _is_int(item.get("epoch")):
            raise ValueError(f"{where} must be a dict with an int 'epoch'")
        if "row_groups" in item:
            if item.get("total") != index.total:
                raise ValueError(f"{where}['total']={item.get('total')} but the split has {index.total} row groups")
            for g in decode_bitmap(item["row_groups"], index.total):
                units.append((item["epoch"], *index.locate(g), None, None))
        else:
            if not (_is_int(item.get("pq_idx")) and _is_int(item.get("rg_idx"))):
                raise ValueError(f"{where} needs int 'pq_idx' and 'rg_idx'")
            rows = tuple(_check_runs(item.get("rows"), where))
            starts = tuple(decode_pieces(item["pieces"], len(rows), where + "['pieces']")) if "pieces" in item else None
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


def hash_tokens(previous: str, tokens: np.ndarray) -> str:
    """The running fingerprint of emitted tokens: sha256(previous digest, the tokens as uint32 LE),
    truncated to 128 bits. ~0.15 ms per 32x2049 batch (hashlib releases the GIL while it hashes)."""
    h = hashlib.sha256(bytes.fromhex(previous))
    h.update(memoryview(np.ascontiguousarray(tokens, dtype="<u4")).cast("B"))
    return h.hexdigest()[:32]


# -----------------------------------------------------------------------------
# Checking a state


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_runs(runs, where: str) -> list[int]:
    if not isinstance(runs, list) or not all(_is_int(r) for r in runs) or (runs and runs[0] < 0):
        raise ValueError(f"{where}: rows must be a list of ints (a row, or -k for the k rows after it)")
    return decode_rows(runs)


FIELDS = {"loader": str, "pq_idx": int, "rg_idx": int, "epoch": int, "plan": list, "next": list,
          "buffer": list, "offset": int, "config": dict, "emitted": dict, "counters": dict, "checksum": str}
# config fields that change which documents a rank reads, in which order: a state taken with other
# values cannot continue the same stream
STREAM_FIELDS = ("loader", "source", "split", "files", "num_files", "chunk_size", "rank", "world_size")


def check_state(state: dict, config: dict, *, allow_mismatch: bool) -> bool:
    """Validate a version-2 state against this loader's config. Returns True when the state continues
    this loader's stream exactly (or, with allow_mismatch, at least the same document stream), False
    when only the seeds' approximate keys can be used (allow_mismatch and another stream)."""
    if state.get("version") != VERSION:
        raise ValueError(f"resume_state_dict['version'] is {state.get('version')!r}; this loader reads "
                         f"version {VERSION} (and the seeds' {{pq_idx, rg_idx, epoch}} form)")
    for key, kind in FIELDS.items():
        if key not in state:
            raise ValueError(f"resume_state_dict is missing {key!r} (a truncated state?)")
        value = state[key]
        if not (isinstance(value, kind) and not isinstance(value, bool)):
            raise ValueError(f"resume_state_dict[{key!r}] must be a {kind.__name__}, got {type(value).__name__}")
    if state["checksum"] != checksum(state) and not allow_mismatch:
        raise ValueError("resume_state_dict['checksum'] does not match its contents: the state was edited "
                         "or corrupted; pass allow_state_mismatch=True to resume from it anyway")
    if len(state["next"]) != 4 or not all(_is_int(v) and v >= 0 for v in state["next"]):
        raise ValueError("resume_state_dict['next'] must be [epoch, pq_idx, rg_idx, row] of ints >= 0")
    emitted = state["emitted"]
    if not (_is_int(emitted.get("batches")) and _is_int(emitted.get("tokens")) and isinstance(emitted.get("hash"), str)):
        raise ValueError("resume_state_dict['emitted'] must hold int 'batches', int 'tokens' and str 'hash'")
    for i, group in enumerate(state["buffer"]):
        if not (isinstance(group, list) and len(group) == 4 and all(_is_int(v) for v in group[:3])):
            raise ValueError(f"resume_state_dict['buffer'][{i}] must be [epoch, pq_idx, rg_idx, rows]")
        _check_runs(group[3], f"resume_state_dict['buffer'][{i}]")
    decode_pieces(state.get("pieces", []), len(decode_keys(state["buffer"])), "resume_state_dict['pieces']")
    saved = dict(state["config"], loader=state["loader"])
    if state["loader"] == "bestfit":  # saved before the long-document policies: the seeds' cropping
        saved = {"long_doc_policy": "crop", "split_overlap": 0} | saved
    differ = [f"{k}: state {saved.get(k)!r}, loader {v!r}" for k, v in config.items() if saved.get(k) != v]
    if differ and not allow_mismatch and {k for k, v in config.items() if saved.get(k) != v} <= {"rank", "world_size"}:
        # nanochat's base_train saves rank 0's state alone and hands it to every rank on resume: such a
        # rank resumes approximately, after the saved row group, exactly as nanochat's own loader does
        logger.warning("resume_state_dict is another rank's state (%s): resuming approximately after its "
                       "file %s, unit %s, as nanochat does; for an exact resume give each rank its own state "
                       "(merge_states for another world size)", "; ".join(differ), state["pq_idx"], state["rg_idx"])
        return False
    if differ and not allow_mismatch:
        raise ValueError("resume_state_dict was taken on another configuration (" + "; ".join(differ) +
                         "); pass allow_state_mismatch=True to resume as well as possible")
    return all(saved.get(k) == config.get(k) for k in STREAM_FIELDS)


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
    from nanochat.dataset import split_parquet_files  # here: resume.py stays importable without the store

    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(states, (list, tuple)) or not states:
        raise ValueError("merge_states needs the list of every rank's state")
    if isinstance(states[0], dict) and states[0].get("loader") == "mixture":
        from nanochat.mixture import merge_mixture_states
        if data_dir is None:
            raise ValueError("data_dir: give the mixture's data directory (holding <split>/<bucket>/)")
        return merge_mixture_states(states, world_size, data_dir=data_dir)
    states = [s["states"][0] if isinstance(s, dict) and "merged" in s and len(s["states"]) == 1 else s
              for s in states]
    for i, s in enumerate(states):
        if not isinstance(s, dict) or s.get("version") != VERSION:
            raise ValueError(f"states[{i}] is not a version-{VERSION} loader state (field 'version')")
        if "merged" in s:
            raise ValueError(f"states[{i}] is a merged state: give each rank's own state, not the merge")
        if s.get("checksum") != checksum(s):
            raise ValueError(f"states[{i}]['checksum'] does not match its contents (edited or corrupted)")
    first = states[0]
    n_old = first["config"]["world_size"]
    if len(states) != n_old:
        raise ValueError(f"config.world_size: the states were taken on {n_old} ranks, but {len(states)} were given")
    for i, s in enumerate(states):
        for key in ("loader", "source", "split", "files", "num_files", "chunk_size", "B", "T", "buffer_size",
                    "tokenizer_batch_size", "tokenizer", "world_size", "long_doc_policy", "split_overlap"):
            if s["config"].get(key) != first["config"].get(key):
                raise ValueError(f"config.{key}: states[{i}] has {s['config'].get(key)!r}, "
                                 f"states[0] has {first['config'].get(key)!r}")
        if s["emitted"]["batches"] != first["emitted"]["batches"]:
            raise ValueError(f"emitted.batches: states[{i}] was taken after {s['emitted']['batches']} batches, "
                             f"states[0] after {first['emitted']['batches']}; merge states of one step")
    ranks = sorted(s["config"]["rank"] for s in states)
    if ranks != list(range(n_old)):
        raise ValueError(f"config.rank: need each of ranks 0..{n_old - 1} once, got {ranks}")
    states = sorted(states, key=lambda s: s["config"]["rank"])
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

    # everything not yet trained on: explicit documents, then whole row groups per epoch
    docs: list[Key] = []
    whole: dict[int, set[int]] = {}
    for i, s in enumerate(states):
        buffered = decode_keys(s["buffer"])
        starts = decode_pieces(s.get("pieces", []), len(buffered), f"states[{i}]['pieces']")
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

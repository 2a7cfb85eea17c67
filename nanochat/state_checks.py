"""
Checking a loader state before it is used: every field on its own (check_fields), every place it refers
to against the data's units (check_data), and whether it continues the stream of the loader resuming from
it (check_state: exactly, approximately as nanochat resumes, or refused with what differs). rank_state
takes one rank's part of a merge. The validators (check_int, check_keys, ...) serve the mixture state too.
Every failure is a ValueError that names the field.

May import: nanochat.state, nanochat.packing, nanochat.shuffle.
"""

import base64
import binascii
import logging
import os
import re
import reprlib

import numpy as np

from nanochat.packing import POLICIES, BestFitPacker, ConcatPacker
from nanochat.shuffle import Shuffle
from nanochat.state import VERSION, checksum_matches

logger = logging.getLogger("nanochat.resume.state_checks")  # child of its old logger

# -----------------------------------------------------------------------------
# Checking a state, field by field
#
# A state can come from anywhere (a checkpoint, a hand edit resealed with add_checksum(), allow_state_mismatch=True),
# so every field is checked before it is used: its shape and values (check_fields, from the state alone),
# then, when the state continues this stream, its places in the data (check_data). Run-length rows and
# bitmaps are measured before they are decoded, so a state cannot make a loader allocate more than its
# buffer and the data's row groups hold. Errors are ValueErrors that name the field.

REQUIRED = ("version", "loader", "pq_idx", "rg_idx", "epoch", "plan", "next", "buffer", "offset", "config",
            "emitted", "counters", "checksum")
# config fields that change which documents a rank reads, in which order: a state taken with other
# values cannot continue the same stream
STREAM_FIELDS = ("loader", "source", "split", "files", "num_files", "chunk_size", "rank", "world_size", "shuffle")
# the config of every version-2 state has these; the later ones came with the pretokenized loader and the policies
CONFIG_FIELDS = ("loader", "split", "files", "num_files", "B", "T", "buffer_size", "tokenizer_batch_size",
                 "tokenizer", "rank", "world_size")
LATER_CONFIG_FIELDS = ("source", "chunk_size", "long_doc_policy", "split_overlap", "shuffle")
COUNTERS = {"bestfit": BestFitPacker.COUNTERS, "concat": ConcatPacker.COUNTERS}


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value, where: str, low: int = 0) -> int:
    if not is_int(value) or value < low:
        raise ValueError(f"{where} must be an int >= {low}, got {reprlib.repr(value)}")
    return value


def check_hex(value, where: str, n: int = 32) -> None:
    if not (isinstance(value, str) and re.fullmatch(f"[0-9a-f]{{{n}}}", value)):
        raise ValueError(f"{where} must be {n} lowercase hex digits (a sha256 prefix), got {reprlib.repr(value)}")


def check_list(value, where: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list, got {type(value).__name__}")
    return value


def check_keys(value, where: str, required, optional=None) -> dict:
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
    if not (isinstance(runs, list) and runs and all(is_int(v) for v in runs) and runs[0] >= 0):
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
    for pair in check_list(pieces, where):
        if not (isinstance(pair, list) and len(pair) == 2 and all(is_int(v) for v in pair)
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
    check_keys(config, where, CONFIG_FIELDS, LATER_CONFIG_FIELDS)
    if config["loader"] != loader:
        raise ValueError(f"{where}['loader'] is {reprlib.repr(config['loader'])}, but the state is a {loader!r} state")
    if config.get("source", "parquet") not in ("parquet", "pretokenized"):
        raise ValueError(f"{where}['source'] must be 'parquet' or 'pretokenized', got {reprlib.repr(config['source'])}")
    for key in ("split", "tokenizer"):
        if not isinstance(config[key], str):
            raise ValueError(f"{where}[{key!r}] must be a str, got {reprlib.repr(config[key])}")
    check_hex(config["files"], f"{where}['files']")
    for key in ("num_files", "B", "T", "tokenizer_batch_size", "world_size", "chunk_size"):
        if key in config:
            check_int(config[key], f"{where}[{key!r}]", 1)
    if loader == "bestfit":
        check_int(config["buffer_size"], f"{where}['buffer_size']", 1)
    elif config["buffer_size"] is not None:
        raise ValueError(f"{where}['buffer_size'] must be None (the concatenating loader has no buffer size), got "
                         f"{reprlib.repr(config['buffer_size'])}")
    if check_int(config["rank"], f"{where}['rank']") >= config["world_size"]:
        raise ValueError(f"{where}['rank'] is {config['rank']}, but world_size is {config['world_size']}")
    policy, overlap = config.get("long_doc_policy", "crop"), config.get("split_overlap", 0)
    if policy not in POLICIES:
        raise ValueError(f"{where}['long_doc_policy'] must be one of {POLICIES}, got {reprlib.repr(policy)}")
    if not (is_int(overlap) and 0 <= overlap < config["T"]) or (overlap and policy == "crop"):
        raise ValueError(f"{where}['split_overlap'] must be an int in [0, T-1] (0 under 'crop'), got "
                         f"{reprlib.repr(overlap)}")
    if "shuffle" in config:  # only shuffled loaders record it
        shuffle = check_keys(config["shuffle"], f"{where}['shuffle']", ("seed", "window"), ("bucket",))
        if not is_int(shuffle["seed"]):
            raise ValueError(f"{where}['shuffle']['seed'] must be an int, got {reprlib.repr(shuffle['seed'])}")
        check_int(shuffle["window"], f"{where}['shuffle']['window']", 1)
        if not isinstance(shuffle.get("bucket", ""), str):
            raise ValueError(f"{where}['shuffle']['bucket'] must be a str, got {reprlib.repr(shuffle['bucket'])}")
    return config


def config_shuffle(config: dict) -> Shuffle | None:
    """The Shuffle a (checked) config records, or None for an unshuffled stream."""
    if "shuffle" not in config:
        return None
    shuffle = config["shuffle"]
    return Shuffle(shuffle["seed"], shuffle["window"], shuffle.get("bucket", ""))


def check_emitted(emitted, where: str) -> None:
    check_keys(emitted, where, ("batches", "tokens", "hash"), ())
    check_int(emitted["batches"], f"{where}['batches']")
    check_int(emitted["tokens"], f"{where}['tokens']")
    check_hex(emitted["hash"], f"{where}['hash']")


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
    check_keys(state, where, REQUIRED, ("pieces",))
    if state["version"] != VERSION:
        raise ValueError(f"{where}['version'] is {reprlib.repr(state['version'])}; this loader reads version {VERSION}")
    loader = state["loader"]
    if not isinstance(loader, str) or loader not in COUNTERS:
        raise ValueError(f"{where}['loader'] must be 'bestfit' or 'concat', got {reprlib.repr(loader)}")
    check_int(state["pq_idx"], f"{where}['pq_idx']")
    check_int(state["rg_idx"], f"{where}['rg_idx']")
    check_int(state["epoch"], f"{where}['epoch']", 1)  # epochs count from 1
    check_hex(state["checksum"], f"{where}['checksum']")
    config = _check_config(state["config"], loader, f"{where}['config']")
    check_emitted(state["emitted"], f"{where}['emitted']")
    counters = check_keys(state["counters"], f"{where}['counters']", ())  # no counter is required: they start at 0
    for name, value in counters.items():
        if name not in COUNTERS[loader]:
            raise ValueError(f"{where}['counters'] has an unknown counter {reprlib.repr(name)} (a {loader} "
                             f"loader's are {', '.join(COUNTERS[loader])})")
        check_int(value, f"{where}['counters'][{name!r}]")
    cursor = check_list(state["next"], f"{where}['next']")
    form = ["epoch >= 1", "window", "row"] if "shuffle" in config else ["epoch >= 1", "pq_idx", "rg_idx", "row"]
    if len(cursor) != len(form) or not all(is_int(v) and v >= 0 for v in cursor) or cursor[0] < 1:
        raise ValueError(f"{where}['next'] must be [{', '.join(form)}] (ints >= 0) for a stream " +
                         ("shuffled by config['shuffle']" if "shuffle" in config else "without config['shuffle']") +
                         f", got {reprlib.repr(cursor)}")

    # the buffer: [[epoch, pq_idx, rg_idx, rows], ...], its pieces, and (concat) the consumed start of its first
    # (a shuffled stream names the documents of its windows by position: [epoch, window, rows])
    buffered, heads = 0, (2, 3) if "shuffle" in config else (3,)
    for i, group in enumerate(check_list(state["buffer"], f"{where}['buffer']")):
        head = len(group) - 1 if isinstance(group, list) else 0
        if not (head in heads and all(is_int(v) and v >= 0 for v in group[:head]) and group[0] >= 1):
            raise ValueError(f"{where}['buffer'][{i}] must be [epoch >= 1, pq_idx, rg_idx, rows]" +
                             (" or [epoch >= 1, window, rows]" if len(heads) == 2 else "") +
                             f", got {reprlib.repr(group)}")
        buffered += _runs(group[-1], f"{where}['buffer'][{i}]")[0]
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
    offset = check_int(state["offset"], f"{where}['offset']")
    if offset and (loader == "bestfit" or not buffered):
        raise ValueError(f"{where}['offset'] must be 0 " + ("for a best-fit state" if loader == "bestfit" else
                                                            "when the buffer is empty") + f", got {offset}")

    # the plan: items of explicit rows (and their pieces), or bitmaps of whole row groups
    for i, item in enumerate(check_list(state["plan"], f"{where}['plan']")):
        at = f"{where}['plan'][{i}]"
        if isinstance(item, dict) and "row_groups" in item:
            check_keys(item, at, ("epoch", "row_groups", "total"), ())
            _bitmap(item["row_groups"], check_int(item["total"], f"{at}['total']", 1), f"{at}['row_groups']")
        else:
            check_keys(item, at, ("epoch", "pq_idx", "rg_idx", "rows"), ("pieces",))
            check_int(item["pq_idx"], f"{at}['pq_idx']")
            check_int(item["rg_idx"], f"{at}['rg_idx']")
            _pieces(item.get("pieces", []), _runs(item["rows"], f"{at}['rows']")[0], f"{at}['pieces']")
        check_int(item["epoch"], f"{at}['epoch']", 1)


def check_data(state: dict, index, where: str = "resume_state_dict") -> None:
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
    shuffle = config_shuffle(state["config"])

    def window_rows(epoch: int, window: int) -> int | None:
        """Entries in a window of this rank's shuffled share of an epoch (None: no such window; -1: just past the
        last one)."""
        windows = -(-len(shuffle.units(epoch, index.total, rank, world_size)) // shuffle.window)
        if window >= windows:
            return -1 if window == windows else None
        return int(shuffle.window_table(index, epoch, rank, world_size, window)[1][-1])

    if shuffle:
        epoch, window, row = state["next"]
        # a window of this rank's share of the epoch, or just past the last one; at a row of it only if it exists
        rows = window_rows(epoch, window)
        if rows is None or (row > 0 and row >= rows):
            raise ValueError(f"{where}['next'] = {state['next']} is not a place where rank {rank} of {world_size} "
                             "reads: the state does not match the data")
    else:
        _, pq_idx, rg_idx, row = state["next"]
        # the regular stream continues at one of this rank's units (rank, rank + world_size, ...), or just past a
        # file's last one; at a row of it only if that row exists
        if not (pq_idx < files and rg_idx % world_size == rank and rg_idx < index.count(pq_idx) + world_size
                and (row == 0 or (rg_idx < index.count(pq_idx) and row < index.rows(pq_idx, rg_idx)))):
            raise ValueError(f"{where}['next'] = {state['next']} is not a place where rank {rank} of {world_size} "
                             f"reads (the data has {files} files): the state does not match the data")
    for i, group in enumerate(state["buffer"]):
        if len(group) == 4:
            rows_in(group[1], group[2], group[3], f"{where}['buffer'][{i}]")
            continue
        epoch, window, runs = group
        rows, largest = window_rows(epoch, window), _runs(runs, f"{where}['buffer'][{i}]")[1]
        if rows is None or largest >= rows:
            raise ValueError(f"{where}['buffer'][{i}] refers to entry {largest} of window {window} of epoch {epoch}, "
                             f"which rank {rank} of {world_size} does not read: the state does not match the data")
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
    check_keys(merged, where, ("version", "merged", "states"), ())
    if merged["version"] != VERSION:
        raise ValueError(f"{where}['version'] is {reprlib.repr(merged['version'])}; this loader reads "
                         f"version {VERSION}")
    info, states = merged["merged"], check_list(merged["states"], f"{where}['states']")
    check_keys(info, f"{where}['merged']", ("from_world_size", "world_size"), ())
    check_int(info["from_world_size"], f"{where}['merged']['from_world_size']", 1)
    if info["world_size"] != len(states):
        raise ValueError(f"{where}['merged']['world_size'] is {reprlib.repr(info['world_size'])}, but it holds "
                         f"{len(states)} states")
    if len(states) != world_size:
        raise ValueError(f"{where}['merged'] is for {len(states)} ranks, but this run has world size {world_size}; "
                         "merge for this world size")
    return check_keys(states[rank], f"{where}['states'][{rank}]", ()), f"{where}['states'][{rank}]"


def check_state(state: dict, config: dict, index, *, allow_mismatch: bool,
                where: str = "resume_state_dict") -> bool:
    """Validate a version-2 state against this loader's config and data. Returns True when the state continues
    this loader's stream exactly (or, with allow_mismatch, at least the same document stream), False when only
    the seeds' approximate keys can be used (another rank's state, or allow_mismatch and another stream)."""
    if state.get("version") != VERSION:
        raise ValueError(f"{where}['version'] is {reprlib.repr(state.get('version'))}; this loader reads "
                         f"version {VERSION} (and the seeds' {{pq_idx, rg_idx, epoch}} form)")
    check_keys(state, where, REQUIRED, ("pieces",))
    if not checksum_matches(state, where) and not allow_mismatch:
        raise ValueError(f"{where}['checksum'] does not match its contents: the state was edited or corrupted; "
                         "pass allow_state_mismatch=True to resume from it anyway")
    check_fields(state, where, config)
    saved = dict(state["config"])
    if state["loader"] == "bestfit":  # saved before the long-document policies: the seeds' cropping
        saved = {"long_doc_policy": "crop", "split_overlap": 0} | saved
    fields = dict.fromkeys([*config, *saved])  # a field only one of them has (shuffle) differs too
    differ = [f"{k}: state {saved.get(k)!r}, loader {config.get(k)!r}" for k in fields if saved.get(k) != config.get(k)]
    if differ and not allow_mismatch and {k for k in fields if saved.get(k) != config.get(k)} <= {"rank", "world_size"}:
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

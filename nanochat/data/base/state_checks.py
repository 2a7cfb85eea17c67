"""
Checking a loader state before it is used, and where a walk resumes from it.
check_resume is the
entry: it tells a merge, a state of this loader and nanochat's {pq_idx, rg_idx, epoch} apart and
says where the walk goes on. check_fields checks every field on its own, check_data every place the
state names against the data, and check_state whether it continues the walk of the loader resuming
from it: exactly, approximately as nanochat resumes, or refused with what differs. rank_state takes
one rank's part of a merge. check_keys, check_hex and check_list serve the mixture state too. Every
failure is a ValueError that names the field.

Cost: run-length indices and bitmaps are measured before they are decoded, so a state cannot
make a loader allocate more than its buffer and the data's units hold. Format: docs/resume.md.

May import: nanochat.data.base.checks, nanochat.data.base.state, nanochat.data.base.packing,
nanochat.data.base.shuffle.
"""

import base64
import binascii
import logging
import os
import re
import reprlib
from typing import NamedTuple

import numpy as np

from nanochat.data.base.checks import check_int, is_int
from nanochat.data.base.packing import POLICIES, BestFitPacker, ConcatPacker
from nanochat.data.base.shuffle import Shuffle
from nanochat.data.base.state import VERSION, Cursor, Position, WindowCursor, checksum_matches

logger = logging.getLogger(__name__)

# -----------------------------------------------------------------------------
# The fields of a state
#
# A state can come from a checkpoint, a hand edit given a new checksum by add_checksum(), or with
# allow_state_mismatch=True: nothing in it is trusted until it is checked here.

REQUIRED = ("version", "loader", "pq_idx", "rg_idx", "epoch", "plan", "next", "buffer", "offset",
            "config", "emitted", "counters", "checksum")
# config fields that change which documents a rank reads, in which order: a state taken with
# other values cannot continue the same walk
WALK_FIELDS = ("loader", "source", "split", "files", "num_files", "chunk_size", "rank",
                 "world_size", "shuffle")
# every version-2 config has these; an absent optional one reads as parquet, no chunks, "crop",
# unshuffled
CONFIG_FIELDS = ("loader", "split", "files", "num_files", "B", "T", "buffer_size",
                 "tokenizer_batch_size", "tokenizer", "rank", "world_size")
OPTIONAL_CONFIG_FIELDS = ("source", "chunk_size", "long_doc_policy", "split_overlap", "shuffle")
COUNTERS = {"bestfit": BestFitPacker.COUNTERS, "concat": ConcatPacker.COUNTERS}
# a key at the top of every loader state: ours, a merge of them, a mixture's, nanochat's
LOADER_KEYS = {*REQUIRED, "merged", "states", "buckets"}
NANOCHAT_KEYS = ("pq_idx", "rg_idx", "epoch")
_key_repr = reprlib.Repr()
_key_repr.maxstring = 80  # a model's keys are dotted paths of ~40 characters: show them whole


# -----------------------------------------------------------------------------
# Where a walk resumes: exactly, approximately as nanochat does, or refused


class Resume(NamedTuple):
    """Where a walk resumes from a checked state: what check_resume returns."""
    resumed: dict | None  # the version-2 state it continues exactly (None: approximately)
    state_name: str  # what messages call that state (a merge's: this rank's part of it)
    cursor: Cursor | WindowCursor  # where the regular walk goes on
    position: Position  # nanochat's keys of the last batch consumed before it


def check_resume(reader, rank: int, world_size: int, state: dict, config: dict, *,
                 allow_state_mismatch: bool, state_name: str = "resume_state_dict",
                 shuffle: Shuffle | None = None, data: bool = True) -> Resume:
    """Check a resume state against a loader's config and the places it names against the data's
    units (reader.index: their footers or indexes; data=False: a version-2 state's places are not
    checked, which may read every footer). Exactly from a version-2 state; approximately from
    nanochat's {pq_idx, rg_idx, epoch}, or from another walk's state when allowed, after the saved
    unit; a shuffled walk only from another rank's state of its own run, after that rank's
    window."""
    if not isinstance(state, dict):
        raise TypeError(f"{state_name} must be a dict, got {type(state).__name__}")
    if message := not_a_loader_state(state, state_name):  # a model's state dict, passed by mistake
        raise ValueError(message)
    if "merged" in state:  # elastic resume: every rank gets the merge, and takes its own part
        state, state_name = rank_state(state, rank, world_size, state_name)
    elif "states" in state:
        raise ValueError(f"{state_name} has 'states' but no 'merged': not a whole merge_states "
                         "result "
                         "(a truncated state?); pass what merge_states returned")
    # (`-` binds before `&`: any key of this loader's states but nanochat's three)
    if "version" not in state and state.keys() & set(REQUIRED) - set(NANOCHAT_KEYS):
        raise ValueError(f"{state_name} is missing 'version' but has this loader's other keys "
                         f"({sorted(state.keys() & set(REQUIRED))}): a truncated state?")
    if "version" in state and check_state(state, config, reader.index if data else None,
                                          allow_mismatch=allow_state_mismatch,
                                          state_name=state_name):
        cursor = WindowCursor(*state["next"]) if shuffle else Cursor(*state["next"])
        return Resume(state, state_name, cursor,
                      Position(state["pq_idx"], state["rg_idx"], state["epoch"]))
    if shuffle:
        return _resume_shuffled(state, config, state_name)
    if "version" in state and allow_state_mismatch:  # (another rank's state has said so already)
        logger.warning("%s is from another walk of the documents; resuming approximately after "
                       "its file %s, %s %s", state_name, state.get("pq_idx"), reader.unit_name,
                       state.get("rg_idx"))
    # nanochat's form: approximate, after the saved unit
    pq_idx, rg_idx, epoch = check_nanochat_state(state, reader, state_name)
    # as nanochat: this rank's unit in the round of world_size units after the saved one
    cursor = Cursor(epoch, pq_idx, (rg_idx // world_size + 1) * world_size + rank, 0)
    return Resume(None, state_name, cursor, Position(pq_idx, rg_idx, epoch))


def _resume_shuffled(state: dict, config: dict, state_name: str) -> Resume:
    """A shuffled walk resumes approximately only from another rank's state of its own run
    (nanochat's base_train), after that rank's window."""
    other = ["nanochat's form"] if "version" not in state else [
        f"{k}: state {state['config'].get(k)!r}, loader {config.get(k)!r}"
        for k in WALK_FIELDS
        if k not in ("rank", "world_size") and state["config"].get(k) != config.get(k)]
    if other:
        raise ValueError(f"{state_name} is not a state of this shuffled walk "
                         f"({'; '.join(other)}), and a shuffled loader cannot tell which "
                         "documents were read under another order or on other data; resume "
                         "with the data and settings the state was taken with, or start afresh")
    epoch, window, _ = state["next"]
    logger.warning("%s is another rank's state: resuming approximately, after its window %d "
                   "of epoch %d", state_name, window, epoch)
    # as nanochat does after the saved unit: from the next window on
    position = Position(state.get("pq_idx"), state.get("rg_idx"), state.get("epoch"))
    return Resume(None, state_name, WindowCursor(epoch, window + 1, 0), position)


def check_nanochat_state(state: dict, reader, state_name: str = "resume_state_dict") -> Position:
    """Validate a state in nanochat's form {pq_idx, rg_idx[, epoch]}: the unit it names."""
    missing = {"pq_idx", "rg_idx"} - state.keys()
    if missing:
        raise ValueError(f"{state_name} is missing {sorted(missing)}")
    # "epoch" is optional: nanochat's concatenating loader's states do not carry it
    values = {"pq_idx": state["pq_idx"], "rg_idx": state["rg_idx"], "epoch": state.get("epoch", 1)}
    for key, value in values.items():
        if not is_int(value):
            raise ValueError(f"{state_name}[{key!r}] must be an int, got {value!r}")
    pq_idx, rg_idx, epoch = values["pq_idx"], values["rg_idx"], values["epoch"]
    if epoch < 1:
        raise ValueError(f"{state_name}['epoch'] must be >= 1 (epochs count from 1), got {epoch}")
    paths = reader.paths
    if not 0 <= pq_idx < len(paths):
        raise ValueError(f"{state_name}['pq_idx']={pq_idx} points past the data: "
                         f"the split has {len(paths)} file(s)")
    num_units = reader.index.count(pq_idx)
    if not 0 <= rg_idx < num_units:
        raise ValueError(f"{state_name}['rg_idx']={rg_idx} points past the data: "
                         f"{paths[pq_idx]} has {num_units} {reader.unit_name}(s)")
    return Position(pq_idx, rg_idx, epoch)


def rank_state(merged: dict, rank: int, world_size: int,
               state_name: str = "resume_state_dict") -> tuple[dict, str]:
    """This rank's part of merge_states' result (every new rank is given all of it), and what
    messages call it."""
    check_keys(merged, state_name, ("version", "merged", "states"), ())
    if merged["version"] != VERSION:
        raise ValueError(f"{state_name}['version'] is {reprlib.repr(merged['version'])}; this "
                         "loader "
                         f"reads version {VERSION}")
    info, states = merged["merged"], check_list(merged["states"], f"{state_name}['states']")
    check_keys(info, f"{state_name}['merged']", ("from_world_size", "world_size"), ())
    check_int(f"{state_name}['merged']['from_world_size']", info["from_world_size"], 1)
    if info["world_size"] != len(states):
        raise ValueError(f"{state_name}['merged']['world_size'] is "
                         f"{reprlib.repr(info['world_size'])}, "
                         f"but it holds {len(states)} states")
    if len(states) != world_size:
        raise ValueError(f"{state_name}['merged'] is for {len(states)} ranks, but this run has "
                         "world "
                         f"size {world_size}; merge for this world size")
    part = f"{state_name}['states'][{rank}]"
    return check_keys(states[rank], part, ()), part


def check_state(state: dict, config: dict, index, *, allow_mismatch: bool,
                state_name: str = "resume_state_dict") -> bool:
    """Validate a version-2 state against this loader's config and data (index: the data's units;
    None: not against the data, which reads the files' footers). Returns True when the state
    continues this loader's walk exactly (or, with allow_mismatch, at least the same document
    walk), False when only nanochat's approximate keys {pq_idx, rg_idx, epoch} can be used
    (another rank's state, or allow_mismatch and another walk)."""
    if state.get("version") != VERSION:
        raise ValueError(f"{state_name}['version'] is {reprlib.repr(state.get('version'))}; this "
                         "loader "
                         f"reads version {VERSION} (and nanochat's {{pq_idx, rg_idx, epoch}} form)")
    check_keys(state, state_name, REQUIRED, ("pieces",))
    if not checksum_matches(state, state_name) and not allow_mismatch:
        raise ValueError(f"{state_name}['checksum'] does not match its contents: the state was "
                         "edited "
                         "or corrupted; pass allow_state_mismatch=True to resume from it anyway")
    check_fields(state, state_name, config)
    saved = dict(state["config"])
    if state["loader"] == "bestfit":  # a config without the policy fields was taken under "crop"
        saved = {"long_doc_policy": "crop", "split_overlap": 0} | saved
    fields = dict.fromkeys([*config, *saved])  # a field only one of them has (shuffle) differs too
    changed = [k for k in fields if saved.get(k) != config.get(k)]
    differ = [f"{k}: state {saved.get(k)!r}, loader {config.get(k)!r}" for k in changed]
    if differ and not allow_mismatch and set(changed) <= {"rank", "world_size"}:
        # nanochat's base_train saves rank 0's state alone and hands it to every rank on resume:
        # such a rank resumes approximately, after the saved row group, as nanochat's loader does
        logger.warning("%s is another rank's state (%s): resuming approximately after its "
                       "file %s, unit %s, as nanochat does; for an exact resume give each rank its "
                       "own state (merge_states for another world size)", state_name,
                       "; ".join(differ), state["pq_idx"], state["rg_idx"])
        return False
    if differ and not allow_mismatch:
        raise ValueError(f"{state_name} was taken on another configuration (" + "; ".join(differ)
                         + "); pass allow_state_mismatch=True to resume as well as possible")
    # only a state of this very walk names places in this data; an approximate resume reads
    # just pq_idx, rg_idx and epoch
    exact = all(saved.get(k) == config.get(k) for k in WALK_FIELDS)
    if exact and index is not None:
        check_data(state, index, state_name)
    return exact


# -----------------------------------------------------------------------------
# Every field on its own


def check_fields(state: dict, state_name: str = "resume_state_dict",
                 loader_config: dict | None = None) -> None:
    """Check every field of a version-2 loader state on its own (check_data checks it against the
    data). loader_config: the config of the loader resuming from it, whose buffer it may fill
    too."""
    check_keys(state, state_name, REQUIRED, ("pieces",))
    if state["version"] != VERSION:
        raise ValueError(f"{state_name}['version'] is {reprlib.repr(state['version'])}; "
                         f"this loader reads version {VERSION}")
    loader = state["loader"]
    if not isinstance(loader, str) or loader not in COUNTERS:  # a list is not hashable: str first
        raise ValueError(f"{state_name}['loader'] must be 'bestfit' or 'concat', "
                         f"got {reprlib.repr(loader)}")
    check_int(f"{state_name}['pq_idx']", state["pq_idx"], 0)
    check_int(f"{state_name}['rg_idx']", state["rg_idx"], 0)
    check_int(f"{state_name}['epoch']", state["epoch"], 1)  # epochs count from 1
    check_hex(state["checksum"], f"{state_name}['checksum']")
    config = _check_config(state["config"], loader, f"{state_name}['config']")
    check_emitted(state["emitted"], f"{state_name}['emitted']")
    # no counter is required: a missing one starts at 0
    counters = check_keys(state["counters"], f"{state_name}['counters']", ())
    for name, value in counters.items():
        if name not in COUNTERS[loader]:
            raise ValueError(f"{state_name}['counters'] has an unknown counter "
                             f"{reprlib.repr(name)} "
                             f"(a {loader} loader's are {', '.join(COUNTERS[loader])})")
        check_int(f"{state_name}['counters'][{name!r}]", value, 0)
    shuffled = "shuffle" in config
    _check_next(state["next"], shuffled, f"{state_name}['next']")
    buffered = _check_buffer(state, shuffled, state_name)
    # measured from the runs, before an index is decoded: a state cannot make the loader allocate
    # more than its buffer holds
    limit = buffer_limit(config, loader)
    if loader_config is not None and loader_config["loader"] == loader:
        # a loader resumed (allow_state_mismatch) from a state with a larger buffer drains it:
        # a loader as large can resume the states it yields meanwhile
        limit = max(limit, buffer_limit(loader_config, loader))
    if buffered > limit:
        raise ValueError(f"{state_name}['buffer'] holds {buffered} whole documents, more than "
                         f"the {limit} a {loader} loader with this config keeps (a loader that "
                         "keeps as many can resume it, with allow_state_mismatch=True)")
    offset = check_int(f"{state_name}['offset']", state["offset"], 0)
    if offset and (loader == "bestfit" or not state["buffer"]):  # only concat consumes part of one
        raise ValueError(f"{state_name}['offset'] must be 0 "
                         + ("for a best-fit state" if loader == "bestfit"
                            else "when the buffer is empty")
                         + f", got {offset}")
    _check_plan(state["plan"], f"{state_name}['plan']")


def _check_next(cursor, shuffled: bool, state_name: str) -> None:
    form = ["epoch >= 1", *(["window", "i"] if shuffled else ["pq_idx", "rg_idx", "doc_index"])]
    cursor = check_list(cursor, state_name)
    if len(cursor) != len(form) or not all(is_int(v) and v >= 0 for v in cursor) or cursor[0] < 1:
        raise ValueError(f"{state_name} must be [{', '.join(form)}] (ints >= 0) for a walk "
                         + ("shuffled by config['shuffle']" if shuffled
                            else "without config['shuffle']")
                         + f", got {reprlib.repr(cursor)}")


def _check_buffer(state: dict, shuffled: bool, state_name: str) -> int:
    """Check the buffer and its pieces; how many whole documents it holds."""
    # [[epoch, pq_idx, rg_idx, doc_indices], ...], or shuffled also [epoch, window, entries]
    buffered, heads = 0, (2, 3) if shuffled else (3,)  # heads: the fields before the indices
    for i, group in enumerate(check_list(state["buffer"], f"{state_name}['buffer']")):
        head = len(group) - 1 if isinstance(group, list) else 0
        if not (head in heads and all(is_int(v) and v >= 0 for v in group[:head])
                and group[0] >= 1):
            raise ValueError(f"{state_name}['buffer'][{i}] must be [epoch >= 1, pq_idx, rg_idx, "
                             "doc_indices]"
                             + (" or [epoch >= 1, window, entries]" if len(heads) == 2 else "")
                             + f", got {reprlib.repr(group)}")
        buffered += _runs(group[-1], f"{state_name}['buffer'][{i}]")[0]
    return buffered - _pieces(state.get("pieces", []), buffered, f"{state_name}['pieces']")


def _check_plan(plan, state_name: str) -> None:
    """Items of listed documents (and their pieces), or bitmaps of whole row groups."""
    for i, item in enumerate(check_list(plan, state_name)):
        at = f"{state_name}[{i}]"
        if isinstance(item, dict) and "row_groups" in item:
            check_keys(item, at, ("epoch", "row_groups", "total"), ())
            total = check_int(f"{at}['total']", item["total"], 1)
            _bitmap(item["row_groups"], total, f"{at}['row_groups']")
        else:
            check_keys(item, at, ("epoch", "pq_idx", "rg_idx", "rows"), ("pieces",))
            check_int(f"{at}['pq_idx']", item["pq_idx"], 0)
            check_int(f"{at}['rg_idx']", item["rg_idx"], 0)
            listed = _runs(item["rows"], f"{at}['rows']")[0]
            _pieces(item.get("pieces", []), listed, f"{at}['pieces']")
        check_int(f"{at}['epoch']", item["epoch"], 1)


# -----------------------------------------------------------------------------
# Every place against the data


def check_data(state: dict, index, state_name: str = "resume_state_dict") -> None:
    """Check that every place a state (through check_fields) refers to is in the data: its files,
    their row groups (or chunks) and documents; and that `next` is in the share of the state's
    rank."""
    files = len(index.paths)
    pq_idx, rg_idx = state["pq_idx"], state["rg_idx"]
    if pq_idx >= files or (rg_idx > 0 and rg_idx >= index.count(pq_idx)):  # (0, 0): no batch yet
        raise ValueError(f"{state_name}['pq_idx'], ['rg_idx'] = {pq_idx}, {rg_idx}: a "
                         f"{_unit(index)} "
                         f"the data does not have ({files} files)")
    rank, world_size = state["config"]["rank"], state["config"]["world_size"]
    shuffle = config_shuffle(state["config"])
    if not _reads_next(state["next"], index, shuffle, rank, world_size):
        raise ValueError(f"{state_name}['next'] = {state['next']} is not a place where rank {rank} "
                         f"of {world_size} reads"
                         + ("" if shuffle else f" (the data has {files} files)")
                         + ": the state does not match the data")
    for i, group in enumerate(state["buffer"]):
        if len(group) == 4:  # [epoch, pq_idx, rg_idx, doc_indices]; 3: [epoch, window, entries]
            _docs_in(index, group[1], group[2], group[3], f"{state_name}['buffer'][{i}]")
            continue
        epoch, window, runs = group
        entries = _window_entries(index, shuffle, rank, world_size, epoch, window)
        largest = _runs(runs, f"{state_name}['buffer'][{i}]")[1]
        if entries is None or largest >= entries:
            raise ValueError(f"{state_name}['buffer'][{i}] refers to entry {largest} of window "
                             f"{window} "
                             f"of epoch {epoch}, which rank {rank} of {world_size} does not read: "
                             "the state does not match the data")
    for i, item in enumerate(state["plan"]):
        at = f"{state_name}['plan'][{i}]"
        if "row_groups" in item:
            if item["total"] != index.total:
                raise ValueError(f"{at}['total'] is {item['total']}, "
                                 f"but the data has {index.total} {_unit(index)}s")
        else:
            listed = _docs_in(index, item["pq_idx"], item["rg_idx"], item["rows"], f"{at}['rows']")
            whole = listed - len(item.get("pieces", []))  # pieces of one document repeat its index
            if whole > index.docs(item["pq_idx"], item["rg_idx"]):
                raise ValueError(f"{at}['rows'] lists {whole} whole documents of a {_unit(index)} "
                                 f"that has {index.docs(item['pq_idx'], item['rg_idx'])}")


def _unit(index) -> str:
    return "row group" if index.chunk_size is None else "chunk"  # chunks: pretokenized shards


def _docs_in(index, pq_idx: int, rg_idx: int, runs, at: str) -> int:
    """How many document indices `runs` lists, checked to be documents of that unit."""
    files = len(index.paths)
    if pq_idx >= files or rg_idx >= index.count(pq_idx):
        raise ValueError(f"{at} refers to file {pq_idx}, {_unit(index)} {rg_idx}, which the data "
                         f"does not have (it has {files} files): the state does not match the data")
    count, largest = _runs(runs, at)
    n = index.docs(pq_idx, rg_idx)
    if largest >= n:
        name = os.path.basename(index.paths[pq_idx])
        raise ValueError(f"{at} refers to document {largest} of {name} {_unit(index)} {rg_idx}, "
                         f"which has {n} documents: the state does not match the data")
    return count


def _window_entries(index, shuffle: Shuffle, rank: int, world_size: int, epoch: int,
                    window: int) -> int | None:
    """Entries in a window of this rank's shuffled share of an epoch (None: no such window;
    -1: just past the last one)."""
    units = len(shuffle.units(epoch, index.total, rank, world_size))
    windows = -(-units // shuffle.window)  # the last window may be short
    if window >= windows:
        return -1 if window == windows else None
    return int(shuffle.window_table(index, epoch, rank, world_size, window).bounds[-1])


def _reads_next(cursor: list, index, shuffle: Shuffle | None, rank: int, world_size: int) -> bool:
    """Whether a state's `next` is a place where the rank's walk goes on."""
    if shuffle:
        epoch, window, i = cursor
        # a window of this rank's share of the epoch, or just past the last one; at an entry of it
        # only if it exists
        entries = _window_entries(index, shuffle, rank, world_size, epoch, window)
        return entries is not None and (i == 0 or i < entries)
    _, pq_idx, rg_idx, doc_index = cursor
    # the regular walk goes on at one of this rank's units (rank, rank + world_size, ...),
    # or just past a file's last one; at a document of it only if that document exists
    files = len(index.paths)
    units = index.count(pq_idx) if pq_idx < files else 0
    return (pq_idx < files and rg_idx % world_size == rank and rg_idx < units + world_size
            and (doc_index == 0 or (rg_idx < units and doc_index < index.docs(pq_idx, rg_idx))))


# -----------------------------------------------------------------------------
# The small checks every field uses


def not_a_loader_state(state, state_name: str = "resume_state_dict") -> str | None:
    """The message for a dict with none of a loader state's keys (a model's or an optimizer's
    state dict, passed by mistake): what it is not, what a loader state is and where it comes from.
    None for anything else, which the checks of its fields then judge."""
    if not isinstance(state, dict) or state.keys() & LOADER_KEYS:
        return None
    keys = [_key_repr.repr(key) for key in list(state)[:3]]  # (a model has hundreds)
    more = f" and {len(state) - 3} more" if len(state) > 3 else ""
    tensors = any(hasattr(v, "shape") and hasattr(v, "dtype") for v in state.values())
    holds = (f"its keys are {', '.join(keys)}{more}" if state else "it is empty") + (
        ", and it holds tensors: a model's or an optimizer's state dict?" if tensors else "")
    return (f"{state_name} is not a loader state ({holds}). A loader state is the third item the "
            "loader yields, (inputs, targets, state_dict): a dict of pq_idx, rg_idx, epoch, "
            "version, plan, ... (nanochat's own: pq_idx, rg_idx, epoch). Save that one with the "
            "checkpoint, e.g. as checkpoint['dataloader_state_dict'], and pass it back")


def check_hex(value, state_name: str, n: int = 32) -> None:
    if not (isinstance(value, str) and re.fullmatch(f"[0-9a-f]{{{n}}}", value)):
        raise ValueError(f"{state_name} must be {n} lowercase hex digits (a sha256 prefix), "
                         f"got {reprlib.repr(value)}")


def check_list(value, state_name: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{state_name} must be a list, got {type(value).__name__}")
    return value


def check_keys(value, state_name: str, required, optional=None) -> dict:
    """value, if it is a dict with every required key and no other than the optional ones
    (optional=None: any other)."""
    if not isinstance(value, dict):
        raise ValueError(f"{state_name} must be a dict, got {type(value).__name__}")
    for key in required:
        if key not in value:
            raise ValueError(f"{state_name} is missing {key!r} (a truncated state?)")
    for key in value if optional is not None else ():
        if key not in required and key not in optional:
            # reprlib: an edited state's key can be any size; the message shows its start
            raise ValueError(f"{state_name} has an unknown field {reprlib.repr(key)}")
    return value


def _runs(runs, state_name: str) -> tuple[int, int]:
    """(how many indices, the largest) of encode_indices' output, measured without decoding it."""
    # runs[0] >= 0: a run (-k) continues the index before it, so one must come first
    if not (isinstance(runs, list) and runs and all(is_int(v) for v in runs) and runs[0] >= 0):
        raise ValueError(f"{state_name} must be a non-empty list of indices (ints >= 0, an index "
                         "followed by "
                         f"-k: the k indices after it too), got {reprlib.repr(runs)}")
    count = index = largest = 0
    for value in runs:
        # an index on its own, or -k: the k indices after the last one
        index, count = (value, count + 1) if value >= 0 else (index - value, count - value)
        largest = max(largest, index)
    return count, largest


def _pieces(pieces, n: int, state_name: str) -> int:
    """Check [[i, start], ...] (indices into n entries, increasing; starts >= 0); how many."""
    previous = -1
    for pair in check_list(pieces, state_name):
        # increasing indices: each buffered entry is at most one piece, as buffered_pieces() writes
        if not (isinstance(pair, list) and len(pair) == 2 and all(is_int(v) for v in pair)
                and previous < pair[0] < n and pair[1] >= 0):
            raise ValueError(f"{state_name}: {reprlib.repr(pair)} is not [index, start] (indices "
                             f"increasing, below {n}; start >= 0)")
        previous = pair[0]
    return len(pieces)


def _bitmap(text, total: int, state_name: str) -> None:
    size = (total + 7) // 8 * 8  # bits: the bitmap is padded with zeros to whole bytes
    if isinstance(text, str) and len(text) == -(-size // 24) * 4:  # base64: 4 chars per 3 bytes
        try:
            data = base64.b64decode(text, validate=True)
            bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
            if len(bits) == size and not bits[total:].any():  # the padding names no unit
                return
        except binascii.Error:
            pass
    raise ValueError(f"{state_name} must be the base64 bitmap of {total} row groups, "
                     f"got {reprlib.repr(text)}")


def _check_config(config, loader: str, state_name: str) -> dict:
    check_keys(config, state_name, CONFIG_FIELDS, OPTIONAL_CONFIG_FIELDS)
    if config["loader"] != loader:
        raise ValueError(f"{state_name}['loader'] is {reprlib.repr(config['loader'])}, "
                         f"but the state is a {loader!r} state")
    if config.get("source", "parquet") not in ("parquet", "pretokenized"):  # absent: parquet
        raise ValueError(f"{state_name}['source'] must be 'parquet' or 'pretokenized', "
                         f"got {reprlib.repr(config['source'])}")
    for key in ("split", "tokenizer"):
        if not isinstance(config[key], str):
            raise ValueError(f"{state_name}[{key!r}] must be a str, got "
                             f"{reprlib.repr(config[key])}")
    check_hex(config["files"], f"{state_name}['files']")
    for key in ("num_files", "B", "T", "tokenizer_batch_size", "world_size", "chunk_size"):
        if key in config:  # chunk_size: only the pretokenized loader's
            check_int(f"{state_name}[{key!r}]", config[key], 1)
    if loader == "bestfit":
        check_int(f"{state_name}['buffer_size']", config["buffer_size"], 1)
    elif config["buffer_size"] is not None:
        raise ValueError(f"{state_name}['buffer_size'] must be None (the concatenating loader has "
                         "no "
                         f"buffer size), got {reprlib.repr(config['buffer_size'])}")
    if check_int(f"{state_name}['rank']", config["rank"], 0) >= config["world_size"]:
        raise ValueError(f"{state_name}['rank'] is {config['rank']}, "
                         f"but world_size is {config['world_size']}")
    # a config without the policy fields was taken under "crop"
    policy, overlap = config.get("long_doc_policy", "crop"), config.get("split_overlap", 0)
    if policy not in POLICIES:
        raise ValueError(f"{state_name}['long_doc_policy'] must be one of {POLICIES}, "
                         f"got {reprlib.repr(policy)}")
    # a piece repeats at most T-1 tokens, so that it brings one new; "crop" cuts no pieces
    high, why = (0, " ('crop' cuts no pieces)") if policy == "crop" else (config["T"] - 1, " (T-1)")
    check_int(f"{state_name}['split_overlap']", overlap, 0, high, hint=why)
    if "shuffle" in config:  # only shuffled loaders record it
        shuffle = check_keys(config["shuffle"], f"{state_name}['shuffle']", ("seed", "window"),
                             ("bucket",))
        check_int(f"{state_name}['shuffle']['seed']", shuffle["seed"])
        check_int(f"{state_name}['shuffle']['window']", shuffle["window"], 1)
        if not isinstance(shuffle.get("bucket", ""), str):  # a mixture's bucket name
            raise ValueError(f"{state_name}['shuffle']['bucket'] must be a str, "
                             f"got {reprlib.repr(shuffle['bucket'])}")
    return config


def config_shuffle(config: dict) -> Shuffle | None:
    """The Shuffle a (checked) config records, or None for an unshuffled walk."""
    if "shuffle" not in config:
        return None
    shuffle = config["shuffle"]
    return Shuffle(shuffle["seed"], shuffle["window"], shuffle.get("bucket", ""))


def check_emitted(emitted, state_name: str) -> None:
    check_keys(emitted, state_name, ("batches", "tokens", "hash"), ())
    check_int(f"{state_name}['batches']", emitted["batches"], 0)
    check_int(f"{state_name}['tokens']", emitted["tokens"], 0)
    check_hex(emitted["hash"], f"{state_name}['hash']")


def buffer_limit(config: dict, loader: str) -> int:
    """The most whole documents a loader keeps buffered after a batch (its pieces come on top)."""
    if loader == "bestfit":
        # best-fit refills a tokenizer batch at a time while it holds fewer than buffer_size
        # documents (a mixture's bucket: fewer than a row's T+1 tokens, each document one at least)
        return max(config["buffer_size"], config["T"] + 1) + config["tokenizer_batch_size"]
    # concatenation refills while it holds fewer than a batch's B*T+1 tokens
    return config["B"] * config["T"] + config["tokenizer_batch_size"]

"""
Elastic resume for one loader: the states of N ranks dealt as plans to M new ranks.
merge_walk_states deals the work that N ranks had not yet trained on to M new ranks, as each new
rank's plan; after its plan, new rank q goes on with the next epoch as rank q of M.
nanochat/resume.py's merge_states is the front users call; a mixture merges each of its buckets with
merge_walk_states (nanochat/data/mixtures/mixture_state.py). Cost: every file's footer (index, or
catalog entry) is read, and no document: states and plans name documents by place.

May import: nanochat.data.base, nanochat.data.loader.order, nanochat.data.pretokenized,
nanochat.data.streaming.catalog.
"""

import os

from nanochat.data.base.datasets import split_parquet_files
from nanochat.data.streaming.catalog import streamed_files
from nanochat.data.base.state import (EMPTY_HASH, VERSION, DocKey, PieceKey, PlanUnit, UnitIndex,
                                      WindowCursor, WindowKey, add_checksum, checksum_matches,
                                      decode_keys, decode_pieces, decode_plan, encode_plan,
                                      files_fingerprint)
from nanochat.data.base.state_checks import buffer_limit, check_data, check_fields, config_shuffle
from nanochat.data.loader.order import parquet_index
from nanochat.data.pretokenized.token_reader import chunk_index
from nanochat.data.base.layout import list_token_shards

# every config field but rank: the states of one run, on one configuration
SAME_CONFIG = ("loader", "source", "split", "files", "num_files", "chunk_size", "B", "T",
               "buffer_size", "tokenizer_batch_size", "tokenizer", "world_size", "long_doc_policy",
               "split_overlap", "shuffle")


def merge_walk_states(states: list, world_size: int, data_dir: str | None, epochs: int | None,
                      names: list[str], stream: tuple | None = None) -> dict:
    """merge_states of best-fit or concatenating states (a mixture merges its buckets' with it);
    names: what messages call each state; stream: (base_url, download limits) for states of a
    streaming loader, whose shards need not be on disk (their catalog says their sizes and row
    groups). Returns {"version": 2, "merged": ..., "states": [one per new rank]}."""
    _check_states(states, names)
    first = states[0]
    n_old = first["config"]["world_size"]
    index = _data_index(first["config"], data_dir, stream)
    shuffle = config_shuffle(first["config"])
    _check_steps(states, names, index, shuffle)
    # in rank order: the deal below must not depend on the order the states came in
    states = sorted(states, key=lambda s: s["config"]["rank"])
    last_epoch = max(s["next"][0] for s in states)  # nothing past the fastest rank's epoch
    if epochs is not None:
        # a finished walk's cursor points past its last epoch
        last_epoch = min(last_epoch, epochs)
    # everything not yet trained on: explicit documents, then whole row groups per epoch
    docs, whole = _left_over(states, index, shuffle)
    for rank, s in enumerate(states):
        # the rest of this rank's share of its current epoch, then all of its share of later ones
        walk = _rest_shuffled if shuffle else _rest_in_files
        rest, later = walk(s["next"], index, shuffle, (rank, n_old), last_epoch)
        docs += rest
        for e, g in later:
            whole.setdefault(e, set()).add(int(g))
    merged = [_new_state(first, plan, q, world_size, last_epoch + 1, shuffle)
              for q, plan in enumerate(_deal(docs, whole, index, world_size))]
    return {"version": VERSION, "merged": {"from_world_size": n_old, "world_size": world_size},
            "states": merged}


# -----------------------------------------------------------------------------
# The states: each checked, all of one run and one step, on the data they name


def _check_states(states: list, names: list[str]) -> None:
    """Every rank's own state, each whole, all of one configuration and one step."""
    for s, name in zip(states, names):
        if not isinstance(s, dict) or s.get("version") != VERSION:
            raise ValueError(f"{name} is not a version-{VERSION} loader state (field 'version')")
        if "merged" in s:
            raise ValueError(f"{name} is a merged state: give each rank's own state, not the merge")
        if not checksum_matches(s, name):
            raise ValueError(f"{name}['checksum'] does not match its contents (edited or "
                             "corrupted)")
        check_fields(s, name)
    first = states[0]
    n_old = first["config"]["world_size"]
    if len(states) != n_old:
        raise ValueError(f"config.world_size: the states were taken on {n_old} ranks, but "
                         f"{len(states)} were given")
    for s, name in zip(states, names):
        for key in SAME_CONFIG:
            if s["config"].get(key) != first["config"].get(key):
                raise ValueError(f"config.{key}: {name} has {s['config'].get(key)!r}, "
                                 f"{names[0]} has {first['config'].get(key)!r}")
        if s["emitted"]["batches"] != first["emitted"]["batches"]:
            raise ValueError(f"emitted.batches: {name} was taken after "
                             f"{s['emitted']['batches']} batches, {names[0]} after "
                             f"{first['emitted']['batches']}; merge states of one step")
    ranks = sorted(s["config"]["rank"] for s in states)
    if ranks != list(range(n_old)):
        raise ValueError(f"config.rank: need each of ranks 0..{n_old - 1} once, got {ranks}")


def _data_index(config: dict, data_dir: str | None, stream: tuple | None) -> UnitIndex:
    """The units of the split the states were taken on, checked to be the same files."""
    chunk_size = config.get("chunk_size")
    sizes = None
    if chunk_size is None and stream is not None:  # streamed parquet: no shard need be on disk
        split = config["split"]
        # train: the loader's first num_files shards; val is one shard, the dataset's last
        num_shards = config["num_files"] if split == "train" else None
        files = streamed_files(split, data_dir, num_shards, *stream)
        paths = files.paths
        sizes = [entry["size"] for entry in files.entries]
        index = parquet_index(paths, [entry["rows"] for entry in files.entries])
    elif chunk_size is None:
        paths = split_parquet_files(config["split"], data_dir)
        index = parquet_index(paths)
    else:
        if data_dir is None:
            raise ValueError("data_dir: give the pretokenized directory the states were taken on")
        paths = [prefix + ".bin" for prefix in
                 list_token_shards(os.path.join(data_dir, config["split"]))]
        index = chunk_index(paths, chunk_size)
    # names and sizes: the plans name documents by place, so the files must be the same
    if files_fingerprint(paths, sizes) != config["files"]:
        raise ValueError("config.files: the shards on disk are not the ones the states were "
                         "taken on")
    return index


def _check_steps(states: list, names: list[str], index: UnitIndex, shuffle) -> None:
    """Each state's places are in the data, and no rank is further ahead of the slowest than the
    tokens it emitted can have read."""
    n_old = states[0]["config"]["world_size"]
    low = min(s["next"][0] for s in states)  # the slowest rank's epoch
    for s, name in zip(states, names):
        check_data(s, index, name)
        # a rank reads at most one document per token it emits, plus its buffer: since its last
        # restart (where all ranks started at one epoch) it cannot have got further ahead of the
        # others than that covers of its share. (A `next` further ahead, hand-edited, would have
        # this merge deal epoch after epoch for a very long time.)
        rank, budget = (s["config"]["rank"],
                        s["emitted"]["tokens"] + buffer_limit(s["config"], s["loader"]))
        read = 0
        # the epochs this rank has finished and the slowest has not
        for epoch in range(low, s["next"][0]):
            read += sum(index.docs(*index.locate(int(g)))
                        for g in _share(index, shuffle, epoch, rank, n_old))
            # (counting epochs too ends the loop when the rank's share is empty)
            if read > budget or epoch - low > budget:
                raise ValueError(f"{name}['next'] is in epoch {s['next'][0]}, "
                                 f"{s['next'][0] - low} past another rank's, more than the "
                                 f"{s['emitted']['tokens']} tokens it emitted can have read of "
                                 "its share: not the states of one step")


# -----------------------------------------------------------------------------
# What is left: buffers and plans, the rest of each walk


def _left_over(states: list, index: UnitIndex, shuffle) -> tuple[list, dict[int, set[int]]]:
    """(documents, {epoch: global indices of whole units}) the states' buffers and plans hold."""
    n_old = states[0]["config"]["world_size"]
    docs: list[DocKey | PieceKey] = []
    whole: dict[int, set[int]] = {}
    for s in states:
        # the buffered documents (a cropped document's discarded tail counts as consumed: a
        # buffer never holds it)
        buffered = _places(decode_keys(s["buffer"]), index, shuffle, s["config"]["rank"], n_old)
        starts = decode_pieces(s.get("pieces", []), len(buffered))
        # a buffered piece of a split document is dealt as that piece alone
        buffered = [key if start is None else PieceKey(*key, start)
                    for key, start in zip(buffered, starts)]
        # a document the concatenating loader had begun: deal its rest, from the first token not
        # consumed (the last batch's last target, when it fell there), so no token is skipped
        if s["loader"] == "concat" and s["offset"] > 0:
            key = buffered[0]
            start = key.start if isinstance(key, PieceKey) else 0
            buffered[0] = PieceKey(key.epoch, key.pq_idx, key.rg_idx, key.doc_index,
                                   start + s["offset"])
        docs += buffered
        for unit in decode_plan(s["plan"], index):
            if unit.doc_indices is None:
                whole.setdefault(unit.epoch, set()).add(index.base(unit.pq_idx) + unit.rg_idx)
            else:
                starts = unit.starts or (None,) * len(unit.doc_indices)
                docs += [DocKey(*_unit_of(unit), r) if st is None
                         else PieceKey(*_unit_of(unit), r, st)
                         for r, st in zip(unit.doc_indices, starts)]
    return docs, whole


def _rest_shuffled(cursor: list, index: UnitIndex, shuffle, ranks: tuple[int, int],
                   last_epoch: int) -> tuple[list[DocKey], list[tuple[int, int]]]:
    """(documents, (epoch, unit) pairs) a shuffled rank has left up to last_epoch: a window begun
    document by document, the windows after it unit by unit."""
    rank, n_old = ranks
    epoch = cursor[0]
    docs, later = [], []
    # (a finished one-pass walk, a mixture's bucket, is past its last epoch)
    if epoch <= last_epoch:
        cursor = WindowCursor(*cursor)
        docs = _window_rest(index, shuffle, rank, n_old, cursor)
        window = cursor.window + (cursor.i > 0)
        later = [(epoch, g) for g in
                 _share(index, shuffle, epoch, rank, n_old)[window * shuffle.window:]]
    later += [(e, g) for e in range(epoch + 1, last_epoch + 1)
              for g in _share(index, shuffle, e, rank, n_old)]
    return docs, later


def _rest_in_files(cursor: list, index: UnitIndex, shuffle, ranks: tuple[int, int],
                   last_epoch: int) -> tuple[list[DocKey], list[tuple[int, int]]]:
    """(documents, (epoch, unit) pairs) a rank has left up to last_epoch, in file order: a unit
    begun document by document, the others whole."""
    rank, n_old = ranks
    epoch, pq_idx, rg_idx, doc_index = cursor
    docs, later = [], []
    for e in range(epoch, last_epoch + 1):
        for p in range(len(index.paths)):
            for g in range(rank, index.count(p), n_old):
                if e == epoch and (p, g) < (pq_idx, rg_idx):  # read already
                    continue
                # begun: its unread documents are dealt one by one
                if e == epoch and (p, g) == (pq_idx, rg_idx) and doc_index > 0:
                    docs += [DocKey(e, p, g, r) for r in range(doc_index, index.docs(p, g))]
                    continue
                later.append((e, index.base(p) + g))
    return docs, later


# -----------------------------------------------------------------------------
# The deal, and the new ranks' states


def _deal(docs: list, whole: dict[int, set[int]], index: UnitIndex,
          world_size: int) -> list[list[PlanUnit]]:
    """Each new rank's plan: documents one by one, then row groups one by one, round-robin over
    the new ranks, so that their shares differ by at most one document and one unit."""
    units: list[list[PlanUnit]] = [[] for _ in range(world_size)]
    for i, key in enumerate(docs):
        piece = (key.start,) if isinstance(key, PieceKey) else None
        units[i % world_size].append(PlanUnit(*_unit_of(key), (key.doc_index,), piece))
    dealt = 0
    for epoch in sorted(whole):
        for g in sorted(whole[epoch]):
            units[dealt % world_size].append(PlanUnit(epoch, *index.locate(g), None, None))
            dealt += 1
    return [encode_plan(_coalesce(plan), index) for plan in units]


def _new_state(first: dict, plan: list[dict], q: int, world_size: int, next_epoch: int,
               shuffle) -> dict:
    """New rank q's state: its plan, then the next epoch from its start, as rank q of world_size."""
    config = dict(first["config"], rank=q, world_size=world_size)
    state = {"version": VERSION, "loader": first["loader"], "pq_idx": first["pq_idx"],
             "rg_idx": first["rg_idx"], "epoch": first["epoch"], "plan": plan,
             "next": [next_epoch, 0, 0] if shuffle else [next_epoch, 0, q, 0],
             "buffer": [], "pieces": [], "offset": 0, "config": config,
             # batches go on (every new rank is at one step); the tokens and hash start over
             "emitted": {"batches": first["emitted"]["batches"], "tokens": 0,
                         "hash": EMPTY_HASH},
             "counters": {}}
    return add_checksum(state)


# -----------------------------------------------------------------------------
# Places and units


def _share(index: UnitIndex, shuffle, epoch: int, rank: int, world_size: int):
    """The global indices of the units a rank reads in an epoch, in its order."""
    if shuffle:
        return shuffle.units(epoch, index.total, rank, world_size)
    return [index.base(p) + g for p in range(len(index.paths))
            for g in range(rank, index.count(p), world_size)]


def _window_rest(index: UnitIndex, shuffle, rank: int, world_size: int,
                 cursor: WindowCursor) -> list[DocKey]:
    """The documents of a shuffled rank's begun window that it has not read yet, in its order."""
    if cursor.i == 0:  # not begun: it is dealt unit by unit, with the windows after it
        return []
    table = shuffle.window_table(index, cursor.epoch, rank, world_size, cursor.window)
    return [DocKey(cursor.epoch, *shuffle.entry(table, i))
            for i in range(cursor.i, int(table.bounds[-1]))]


def _places(keys: list, index: UnitIndex, shuffle, rank: int, world_size: int) -> list[DocKey]:
    """Where buffered documents are: a shuffled walk keys those of its windows by position,
    (epoch, window, i)."""
    tables: dict = {}  # (epoch, window) -> its table, built once for all its documents
    places = []
    for key in keys:
        if isinstance(key, WindowKey):
            epoch, window, i = key
            if (epoch, window) not in tables:
                tables[epoch, window] = shuffle.window_table(index, epoch, rank, world_size, window)
            key = DocKey(epoch, *shuffle.entry(tables[epoch, window], i))
        places.append(key)
    return places


def _unit_of(key) -> tuple[int, int, int]:
    """(epoch, pq_idx, rg_idx): the unit of a DocKey, a PieceKey or a PlanUnit."""
    return key.epoch, key.pq_idx, key.rg_idx


def _coalesce(units: list[PlanUnit]) -> list[PlanUnit]:
    """Join consecutive single-document units of one row group: a new rank's plan stays short."""
    out: list[PlanUnit] = []
    for unit in units:
        last = out[-1] if out else None
        if (last and unit.doc_indices is not None and last.doc_indices is not None
                and _unit_of(last) == _unit_of(unit)):
            starts = None  # pieces stay None when neither part has one: whole documents
            if last.starts is not None or unit.starts is not None:
                starts = ((last.starts or (None,) * len(last.doc_indices))
                          + (unit.starts or (None,) * len(unit.doc_indices)))
            out[-1] = unit._replace(doc_indices=last.doc_indices + unit.doc_indices, starts=starts)
        else:
            out.append(unit)
    return out

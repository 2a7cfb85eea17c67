"""
Resuming from a loader state: matching a saved state to the loader that resumes from it
(check_state, rank_state), and elastic resume, merging the states of N ranks into the start of M.

Elastic resume: `merge_states(states, world_size)` takes the states of all N ranks at one step and
returns {"version": 2, "merged": ..., "states": [one per new rank]}. Every document not yet trained on
(still buffered, the unread rest of a row group, or a row group not yet read in the current epoch) is
dealt round-robin to exactly one new rank as its plan; after its plan, new rank q continues with the
next epoch as rank q of M. The discarded tail of a cropped document counts as consumed. A buffered
piece of a split document is dealt as that piece alone, and so is the unconsumed rest of a document
the concatenating loader had started (from its first token not yet consumed: the last target of the
last batch, if it fell there), so that loader skips no token across an elastic restart either.

The state's format and its field checks are nanochat/state.py; mixture states are merged by
nanochat/mixture_state.py, bucket by bucket, with merge_stream_states.

May import: nanochat.state, nanochat.readers, nanochat.dataset, nanochat.token_shards.
"""

import logging
import os
import reprlib

from nanochat.dataset import split_parquet_files
from nanochat.readers import RowGroupIndex
from nanochat.state import (EMPTY_HASH, REQUIRED, STREAM_FIELDS, VERSION, Key, Unit, buffer_limit, check_data,
                            check_fields, check_int, check_keys, check_list, decode_keys, decode_pieces,
                            decode_plan, encode_plan, files_fingerprint, intact, seal)
from nanochat.token_shards import list_token_shards

logger = logging.getLogger(__name__)


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


def check_state(state: dict, config: dict, index: RowGroupIndex, *, allow_mismatch: bool,
                where: str = "resume_state_dict") -> bool:
    """Validate a version-2 state against this loader's config and data. Returns True when the state continues
    this loader's stream exactly (or, with allow_mismatch, at least the same document stream), False when only
    the seeds' approximate keys can be used (another rank's state, or allow_mismatch and another stream)."""
    if state.get("version") != VERSION:
        raise ValueError(f"{where}['version'] is {reprlib.repr(state.get('version'))}; this loader reads "
                         f"version {VERSION} (and the seeds' {{pq_idx, rg_idx, epoch}} form)")
    check_keys(state, where, REQUIRED, ("pieces",))
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
    directory; for the pretokenized loader, its directory holding train/ and val/). epochs: the streams
    read their data this many times and then end; nothing past it is dealt. Mixture states are merged by
    nanochat.mixture.merge_mixture_states."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(states, (list, tuple)) or not states:
        raise ValueError("merge_states needs the list of every rank's state")
    if isinstance(states[0], dict) and states[0].get("loader") == "mixture":
        raise ValueError("states[0] is a mixture loader's state: merge mixture states with "
                         "nanochat.mixture.merge_mixture_states(states, world_size, data_dir=...)")
    # the merge of one rank, given as that rank's state
    states = [s["states"][0] if isinstance(s, dict) and "merged" in s and isinstance(s.get("states"), list)
              and len(s["states"]) == 1 else s for s in states]
    return merge_stream_states(states, world_size, data_dir, epochs, [f"states[{i}]" for i in range(len(states))])


def merge_stream_states(states: list, world_size: int, data_dir: str | None, epochs: int | None,
                        names: list[str]) -> dict:
    """merge_states of best-fit or concatenating states (a mixture merges its buckets' with it);
    names: what messages call each state."""
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

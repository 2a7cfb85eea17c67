"""
The mixture loader's state: its fields, their checks, the resume match, the elastic merge.
A resume matches a saved state to the resuming loader; the merge takes the states of N ranks for M.
A mixture state holds the curriculum's position and one best-fit loader state per bucket;
nanochat/data/loader/elastic.py merges each bucket's documents. Format: docs/mixtures.md#the-state.

May import: nanochat.data.base.checks, nanochat.data.base.state, nanochat.data.base.state_checks,
nanochat.data.loader.elastic.
"""

import os
import reprlib

from nanochat.data.base.checks import check_int, is_int
from nanochat.data.loader.elastic import merge_walk_states
from nanochat.data.base.state import EMPTY_HASH, VERSION, checksum, checksum_matches
from nanochat.data.base.state_checks import (check_emitted, check_hex, check_keys, check_list,
                                   not_a_loader_state, rank_state)

FIELDS = ("version", "loader", "phase", "phase_tokens_done", "tokens_done", "position",
          "generation", "dropped", "buckets", "config", "emitted", "checksum")
CONFIG_FIELDS = ("loader", "source", "split", "buckets", "chunk_size", "B", "T", "buffer_size",
                 "tokenizer_batch_size", "tokenizer", "seed", "curriculum", "rank", "world_size",
                 "long_doc_policy", "split_overlap")


def mixture_checksum(state: dict) -> str:
    """A mixture state's checksum: its own fields, and each bucket state by that state's checksum
    (which covers the bucket's contents and is checked when the bucket resumes), so each batch's
    state is serialised once, not twice."""
    buckets = state.get("buckets")
    if not isinstance(buckets, dict) or not all(isinstance(b, dict) for b in buckets.values()):
        return ""  # matches no stored checksum: the state is refused by name
    return checksum(dict(state, buckets={name: b.get("checksum") for name, b in buckets.items()}))


def add_mixture_checksum(state: dict) -> dict:
    state["checksum"] = mixture_checksum(state)
    return state


def mixture_start(state, config, rank, world_size, allow_mismatch) -> tuple[dict | None, str]:
    """Validate a mixture resume state (or a merge of them) against this loader; returns this
    rank's, and what messages call it (its bucket states are checked when each bucket resumes)."""
    state_name = "resume_state_dict"
    if state is None:
        return None, state_name
    if not isinstance(state, dict):
        raise TypeError(f"resume_state_dict must be a dict, got {type(state).__name__}")
    if message := not_a_loader_state(state, state_name):  # a model's state dict, passed by mistake
        raise ValueError(message)
    if "merged" in state:  # every new rank is given the whole merge and takes its own part
        state, state_name = rank_state(state, rank, world_size)
    if state.get("version") != VERSION or state.get("loader") != "mixture":
        raise ValueError(f"{state_name} is not a mixture loader state (version 2, loader "
                         "'mixture')")
    check_keys(state, state_name, FIELDS, ())
    if not checksum_matches(state, state_name, mixture_checksum) and not allow_mismatch:
        raise ValueError(f"{state_name}['checksum'] does not match its contents: the state was "
                         "edited "
                         "or corrupted; pass allow_state_mismatch=True to resume from it anyway")
    check_mixture_fields(state, state_name)
    saved = state["config"]
    fields = dict.fromkeys([*config, *saved])  # a field only one of them has (shuffle) differs too
    differ = [f"{k}: state {saved.get(k)!r}, loader {config.get(k)!r}"
              for k in fields if saved.get(k) != config.get(k)]
    # fields that change which documents each bucket yields: no resume can go on past them
    walk_fields = ("source", "split", "buckets", "chunk_size", "tokenizer", "rank", "world_size",
                     "shuffle")
    if "shuffle" in config or "shuffle" in saved:  # the seed orders the buckets' documents too
        walk_fields += ("seed",)
    walk_changed = any(saved.get(k) != config.get(k) for k in walk_fields)
    if differ and (not allow_mismatch or walk_changed):
        hint = ("; pass allow_state_mismatch=True to go on with a changed curriculum, "
                + ("" if "seed" in walk_fields else "seed, ") + "B, T or buffer size")
        raise ValueError(f"{state_name} was taken on another configuration ("
                         + "; ".join(differ) + ")"
                         + ("" if allow_mismatch or walk_changed else hint))
    return state, state_name


def check_mixture_fields(state: dict, state_name: str) -> None:
    """Check every field of a mixture state but its bucket states (checked when each bucket
    resumes, or by merge_mixture_states): a ValueError naming the field."""
    config = check_keys(state["config"], f"{state_name}['config']", CONFIG_FIELDS, ("shuffle",))
    if "shuffle" in config:  # {"window": chunks}: the buckets' own configs hold the rest
        check_keys(config["shuffle"], f"{state_name}['config']['shuffle']", ("window",), ())
        check_int(f"{state_name}['config']['shuffle']['window']", config["shuffle"]["window"], 1)
    names = check_keys(config["buckets"], f"{state_name}['config']['buckets']", ())
    for name, files in names.items():  # bucket name -> its files' fingerprint
        check_hex(files, f"{state_name}['config']['buckets'][{name!r}]")
    for key in ("chunk_size", "B", "T", "buffer_size", "tokenizer_batch_size", "world_size"):
        check_int(f"{state_name}['config'][{key!r}]", config[key], 1)
    if check_int(f"{state_name}['config']['rank']", config["rank"], 0) >= config["world_size"]:
        raise ValueError(f"{state_name}['config']['rank'] is {config['rank']}, "
                         f"but world_size is {config['world_size']}")
    phases = check_list(config["curriculum"], f"{state_name}['config']['curriculum']")
    for i, phase in enumerate(phases):
        if not (isinstance(phase, list) and len(phase) == 2 and is_int(phase[0]) and phase[0] >= 1
                and isinstance(phase[1], list)
                and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                        and p[0] in names for p in phase[1])):
            raise ValueError(f"{state_name}['config']['curriculum'][{i}] must be "
                             "[tokens, [[bucket, weight], ...]]")
    check_int(f"{state_name}['phase']", state["phase"], 1)  # phases count from 1
    if state["phase"] > len(phases):
        raise ValueError(f"{state_name}['phase'] is {state['phase']}, "
                         f"but the curriculum has {len(phases)} phases")
    check_int(f"{state_name}['tokens_done']", state["tokens_done"], 0)
    phase_tokens = check_int(f"{state_name}['phase_tokens_done']", state["phase_tokens_done"], 0)
    if phase_tokens > state["tokens_done"]:  # tokens_done counts every phase's
        raise ValueError(f"{state_name}['phase_tokens_done'] is {state['phase_tokens_done']}, more "
                         "than "
                         f"tokens_done {state['tokens_done']}")
    check_int(f"{state_name}['position']", state["position"], 0)
    check_int(f"{state_name}['generation']", state["generation"], 0)
    dropped = check_list(state["dropped"], f"{state_name}['dropped']")
    if (not all(isinstance(name, str) and name in names for name in dropped)
            or len(set(dropped)) != len(dropped)):
        raise ValueError(f"{state_name}['dropped'] must list buckets of the mixture "
                         f"({', '.join(names)}) once each, got {reprlib.repr(dropped)}")
    # one state per bucket of the config, no other
    buckets = check_keys(state["buckets"], f"{state_name}['buckets']", names, ())
    for name, bucket in buckets.items():
        check_keys(bucket, f"{state_name}['buckets'][{name!r}]", ())
    check_emitted(state["emitted"], f"{state_name}['emitted']")


def merge_mixture_states(states: list[dict], world_size: int, *, data_dir: str) -> dict:
    """Merge the mixture states of all N ranks at one step into the resume state of M ranks: every
    bucket's remaining documents are dealt by elastic.merge_walk_states; the phase and tokens
    done carry over, and the new ranks start a fresh mix sequence (generation + 1). A bucket stays
    dropped only if every old rank had dropped it."""
    world_size = check_int("world_size", world_size, 1)
    if not isinstance(states, (list, tuple)) or not states:
        raise ValueError("merge_mixture_states needs the list of every rank's state")
    data_dir = os.path.expanduser(os.fspath(data_dir))
    for i, s in enumerate(states):
        if not isinstance(s, dict) or s.get("loader") != "mixture" or s.get("version") != VERSION:
            raise ValueError(f"states[{i}] is not a mixture loader state "
                             "(version 2, loader 'mixture')")
        check_keys(s, f"states[{i}]", FIELDS, ())
        if not checksum_matches(s, f"states[{i}]", mixture_checksum):
            raise ValueError(f"states[{i}]['checksum'] does not match its contents "
                             "(edited or corrupted)")
        check_mixture_fields(s, f"states[{i}]")
    first = states[0]
    for i, s in enumerate(states):
        for key in ("tokens_done", "phase", "generation"):
            if s[key] != first[key]:
                raise ValueError(f"{key}: states[{i}] has {s[key]!r}, states[0] has "
                                 f"{first[key]!r}; merge states of one step")
        # every rank's config is the same but for its rank
        if ({k: v for k, v in s["config"].items() if k != "rank"}
                != {k: v for k, v in first["config"].items() if k != "rank"}):
            raise ValueError(f"config: states[{i}] was taken on another configuration "
                             "than states[0]")
    # a mixture reads each bucket once (epochs=1): a bucket that runs dry is exhausted, not reread
    per_bucket = {name: merge_walk_states([s["buckets"][name] for s in states], world_size,
                                            data_dir, 1, [f"states[{i}]['buckets'][{name!r}]"
                                                          for i in range(len(states))])
                  for name in first["buckets"]}
    # a bucket one old rank still read has documents left, now dealt to every new rank
    dropped = sorted(set.intersection(*(set(s["dropped"]) for s in states)))
    merged = []
    for q in range(world_size):
        merged.append(add_mixture_checksum({
            "version": VERSION, "loader": "mixture", "phase": first["phase"],
            "phase_tokens_done": first["phase_tokens_done"], "tokens_done": first["tokens_done"],
            "position": 0,  # a fresh mix sequence starts at its beginning
            "generation": first["generation"] + 1, "dropped": dropped,
            "buckets": {name: m["states"][q] for name, m in per_bucket.items()},
            "config": dict(first["config"], rank=q, world_size=world_size),
            # the hash restarts: the new ranks' tokens are not any old rank's
            "emitted": {"batches": first["emitted"]["batches"], "tokens": 0, "hash": EMPTY_HASH},
        }))
    return {"version": VERSION,
            "merged": {"from_world_size": len(states), "world_size": world_size},
            "states": merged}

"""
Resume: the one call a training script needs to restart on another number of ranks.

    from nanochat.resume import merge_states
    merged = merge_states(states, world_size=M)   # every rank's state, taken at one step
    loader = ...(resume_state_dict=merged)         # each new rank takes its own part

This module only tells the states apart: nanochat/data/loader/elastic.py merges a best-fit or
concatenating loader's, nanochat/data/mixtures/mixture_state.py a mixture's. Format and guide:
docs/resume.md.

May import: nanochat.data.base.checks, nanochat.data.loader.elastic,
nanochat.data.mixtures.mixture_state, nanochat.data.fetch.limits,
nanochat.data.base.state_checks.
"""

import os

from nanochat.data.base.checks import check_int, check_stream
from nanochat.data.fetch.limits import Limits
from nanochat.data.loader.elastic import merge_walk_states
from nanochat.data.mixtures.mixture_state import merge_mixture_states

from nanochat.data.base.state_checks import not_a_loader_state


def merge_states(states: list[dict], world_size: int, *, data_dir: str | None = None,
                 epochs: int | None = None, stream: bool | None = None,
                 base_url: str | None = None, download_limits: Limits | None = None) -> dict:
    """Merge the states of all N ranks, taken at the same step, into the resume state of M ranks.

    Each rank saves its own state with its checkpoint; to restart on M ranks, load all N, call
    merge_states(states, M), and give the result to every new rank as resume_state_dict (rank r of
    M picks its part). data_dir: where the shards are, as given to the loader (default: the dataset
    directory; for the pretokenized loader, its directory holding train/ and val/; for a mixture,
    its data directory, required). epochs: the walks read their data this many times and then
    end (a mixture's buckets: once); nothing past it is dealt. stream (default: NANOCHAT_STREAM=1):
    the states are a streaming loader's, whose shards need not be on disk (data_dir is its cache;
    base_url and download_limits as given to the loader): their sizes and row groups come from its
    catalog."""
    world_size = check_int("world_size", world_size, 1)
    if not isinstance(states, (list, tuple)) or not states:
        raise ValueError("merge_states needs the list of every rank's state")
    for i, state in enumerate(states):  # a model's state dict, saved in its place by mistake
        if message := not_a_loader_state(state, f"states[{i}]"):
            raise ValueError(message)
    data_dir = None if data_dir is None else os.path.expanduser(os.fspath(data_dir))
    # a mixture's states: one of them is enough to tell (a damaged one is then refused by the
    # mixture's checks)
    if any(isinstance(s, dict) and (s.get("loader") == "mixture" or "buckets" in s)
           for s in states):
        if data_dir is None:
            raise ValueError("data_dir: give the mixture's data directory "
                             "(holding <split>/<bucket>/)")
        return merge_mixture_states(states, world_size, data_dir=data_dir)
    # a merge for a single rank holds that rank's state, as the loader would read it
    states = [s["states"][0] if isinstance(s, dict) and "merged" in s
              and isinstance(s.get("states"), list) and len(s["states"]) == 1 else s
              for s in states]
    streaming = None  # or (base_url, limits): the shards' catalog, for a streaming loader's states
    if check_stream(stream, None, 0, None, None) is not None:  # only stream= is read here
        streaming = (base_url, Limits() if download_limits is None else download_limits)
    names = [f"states[{i}]" for i in range(len(states))]  # what messages call each state
    return merge_walk_states(states, world_size, data_dir, epochs, names, streaming)

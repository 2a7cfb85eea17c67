"""
The mixture loader's plan, made and checked at its call.
The mixture loader's plan, made at its call: every argument checked, the buckets listed and the
curriculum loaded, the configuration its state records, the resume state matched to it (or, for a
fresh run, the curriculum checked against the buckets: a predicted shortfall is refused), and each
used bucket's walk of its pretokenized shards. Cost: the .idx headers of every bucket.

May import: nanochat.data.base, nanochat.data.base.checks, nanochat.data.loader.rows,
nanochat.data.pretokenized.token_reader, nanochat.data.mixtures.curriculum,
nanochat.data.mixtures.mixture_state, nanochat.data.mixtures.mix.
"""

import logging
import os
from typing import Any, NamedTuple

from nanochat.data.base.packing import check_long_doc_policy
from nanochat.data.base.shuffle import Shuffle
from nanochat.data.base.state import files_fingerprint, loader_config
from nanochat.data.base.checks import check_options, check_shuffle, resolve_rank
from nanochat.data.loader.rows import EntryDocuments
from nanochat.data.mixtures.curriculum import Phase, list_buckets, load_curriculum, validate
from nanochat.data.mixtures.mix import MixRules
from nanochat.data.mixtures.mixture_state import mixture_start
from nanochat.data.pretokenized.token_reader import TokenShardReader, shard_vocab

logger = logging.getLogger(__name__)


class MixtureOptions(NamedTuple):
    """The arguments of pretokenized_mixture_loader_with_state_bos_bestfit, as given (its docstring
    says what each means)."""
    B: int
    T: int
    split: str
    curriculum: Any
    device: Any
    resume_state_dict: dict | None
    buffer_size: int
    data_dir: Any
    seed: int
    bos_token: int | None
    chunk_size: int
    batch_size: int
    rank: int | None
    world_size: int | None
    prefetch: int
    with_state: bool
    allow_state_mismatch: bool
    allow_bucket_exhaustion: bool
    allow_budget_mismatch: bool
    total_tokens: int | None
    trace_documents: bool
    long_doc_policy: str
    split_overlap: int
    vocab_size: int | None
    shuffle: bool
    shuffle_window: int
    workers: int | None


class BucketWalk(NamedTuple):
    """One used bucket: what the loader's walk of it reads, and where its state resumes."""
    name: str
    reader: TokenShardReader
    config: dict  # the bucket's own loader config (its state's)
    shuffle: Shuffle | None  # the bucket's shuffled order, or None
    state: dict | None  # the bucket's state in the resume state, or None
    state_name: str  # what messages call that state


class MixturePlan(NamedTuple):
    """What the mixture loader is built from."""
    phases: list[Phase]
    rules: MixRules
    config: dict  # what the mixture state records and a resume must match
    state: dict | None  # this rank's resume state, checked; None: a fresh run
    encoder: EntryDocuments  # entries to documents, the BOS prepended where missing
    buckets: list[BucketWalk]  # the buckets the curriculum uses, by name


def plan_mixture(options: MixtureOptions) -> MixturePlan:
    """Check the mixture loader's arguments and its state, and the curriculum against the buckets
    when it starts afresh; a ValueError (or TypeError) names what is wrong."""
    o = options
    check_options(o.B, o.T, o.split, o.prefetch, buffer_size=o.buffer_size,
                  chunk_size=o.chunk_size, batch_size=o.batch_size)
    check_long_doc_policy(o.long_doc_policy, o.split_overlap, o.T)
    shuffle = check_shuffle(o.shuffle, o.seed, o.shuffle_window)
    rank, world_size = resolve_rank(o.rank, o.world_size)
    data_dir = os.path.expanduser(os.fspath(o.data_dir))
    paths = list_buckets(data_dir, o.split)
    phases = load_curriculum(o.curriculum, paths)
    # the vocabulary and the BOS: the arguments, or pretokenize.json in data_dir or in a bucket's
    # directory (all must agree)
    vocab = shard_vocab(next(iter(paths.values()))[0], o.bos_token, o.vocab_size,
                        [data_dir] + [os.path.join(data_dir, o.split, name) for name in paths])
    used = sorted({name for p in phases for name in p.mix})
    config = _mixture_config(o, phases, {name: paths[name] for name in used}, vocab.bos_token,
                             (rank, world_size))
    state, state_name = mixture_start(o.resume_state_dict, config, rank, world_size,
                                      o.allow_state_mismatch)
    _check_fit(o, phases, data_dir, shuffle, world_size, fresh=state is None)
    walks = []
    for name in used:
        bucket_shuffle = shuffle and shuffle.bucket(name)
        sub_config = loader_config("bestfit", "pretokenized", f"{o.split}/{name}", paths[name],
                                   B=o.B, T=o.T, buffer_size=o.buffer_size,
                                   batch_size=o.batch_size, tokenizer=config["tokenizer"],
                                   rank=rank, world_size=world_size, chunk_size=o.chunk_size,
                                   policy=(o.long_doc_policy, o.split_overlap),
                                   shuffle=bucket_shuffle)
        walks.append(BucketWalk(name, TokenShardReader(paths[name], o.chunk_size, vocab),
                                sub_config, bucket_shuffle,
                                state["buckets"][name] if state else None,
                                f"{state_name}['buckets'][{name!r}]"))
    rules = MixRules(o.B, o.T, rank, world_size, o.seed, o.buffer_size, o.allow_bucket_exhaustion,
                     o.allow_budget_mismatch)
    encoder = EntryDocuments(vocab.bos_token, always=vocab.convention == "gpt-simple")
    return MixturePlan(phases, rules, config, state, encoder, walks)


def _mixture_config(o: MixtureOptions, phases: list[Phase], paths: dict, bos_token: int,
                    ranks: tuple[int, int]) -> dict:
    """What the mixture's state records of its configuration (paths: each used bucket's shards;
    ranks: (rank, world_size))."""
    rank, world_size = ranks
    config = {"loader": "mixture", "source": "pretokenized", "split": o.split,
              "buckets": {name: files_fingerprint(files) for name, files in paths.items()},
              "chunk_size": o.chunk_size, "B": o.B, "T": o.T, "buffer_size": o.buffer_size,
              "tokenizer_batch_size": o.batch_size, "tokenizer": f"bos:{bos_token}",
              "seed": o.seed,
              "curriculum": [[p.tokens, [[name, w] for name, w in sorted(p.mix.items())]]
                             for p in phases],
              "rank": rank, "world_size": world_size, "long_doc_policy": o.long_doc_policy,
              "split_overlap": o.split_overlap}
    if o.shuffle:  # (an unshuffled mixture's config has no "shuffle" key at all)
        config["shuffle"] = {"window": o.shuffle_window}
    return config


def _check_fit(o: MixtureOptions, phases: list[Phase], data_dir: str, shuffle: Shuffle | None,
               world_size: int, *, fresh: bool) -> None:
    """A fresh run: refuse a curriculum that is predicted to run dry, and log what only may. A
    resumed one: refuse a budget mismatch (unless allowed)."""
    step_tokens = o.B * o.T * world_size  # tokens the whole job trains per step
    planned = sum(p.tokens for p in phases)
    if fresh:
        _, problems, notes = validate(
            phases, data_dir, o.split, total_tokens=o.total_tokens,
            allow_bucket_exhaustion=o.allow_bucket_exhaustion,
            allow_budget_mismatch=o.allow_budget_mismatch, T=o.T, world_size=world_size,
            chunk_size=o.chunk_size, step_tokens=step_tokens, shuffle=shuffle,
            long_doc_policy=o.long_doc_policy)
        for note in notes:
            logger.warning("mixture: %s", note)
        if problems:
            raise ValueError("the curriculum does not fit the data: " + "; ".join(problems) +
                             " (python -m nanochat.mixture validate prints the whole table; "
                             "allow_bucket_exhaustion / allow_budget_mismatch accept it)")
    elif (o.total_tokens is not None and abs(o.total_tokens - planned) >= step_tokens
          and not o.allow_budget_mismatch):
        raise ValueError(f"budget mismatch: the curriculum totals {planned:,} tokens, the run will "
                         f"train {o.total_tokens:,}; pass allow_budget_mismatch=True to accept it")

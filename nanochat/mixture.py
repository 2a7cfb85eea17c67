"""
Data mixtures and curricula over pretokenized buckets (seed 003's layout and rules).

    <data_dir>/train/<bucket>/*.bin *.idx      one `python -m nanochat.pretokenize` output per bucket
    <data_dir>/val/<bucket>/...

A curriculum is an ordered list of phases, each a token budget and a mix of bucket weights, as a
YAML or JSON file or a Python list:

    curriculum:
      - tokens: 5_000_000_000               # (seed 003's name, duration_tokens, works too)
        mix: {web: 0.6, code: 0.2, math: 0.1, wiki: 0.1}
      - tokens: 5_000_000_000
        mix: {web: 0.3, code: 0.3, math: 0.2, wiki: 0.2}

How it mixes. Every row of a batch comes whole from one bucket, best-fit packed from that bucket's own
buffer by the same packer as the other loaders (so every row starts with BOS, and long_doc_policy
applies). Row n of rank r (of W) in phase p comes from the bucket whose slice of [0, 1) (the phase's
weights, in bucket-name order) holds

    u = frac(h(seed, p, generation) + (n * W + r) * (sqrt(5) - 1) / 2)

a counter-based function of (seed, rank, position): no generator state, so a resume continues the
sequence exactly. h is a hash (blake2b); the golden-ratio steps make the sequence low-discrepancy, and
the job's rows of consecutive steps are one contiguous stretch of it, so over any N of them every
bucket's count is within a few rows of N * weight. Rows are all T+1 tokens, so the realised token mix
follows the weights whatever the buckets' document lengths: within 1 point over every 1M tokens of
the job (whole steps) up to T=4096 (at T=2048 a row is 1/488 of the window; at T=8192 a single row is
0.8 points, and the gap reaches 1.7).

Phases. The phase of a batch is set by the tokens the whole job trained before it (B * T * world_size
per step), so all ranks switch at the same step; a phase boundary falls on a step boundary (a phase
shorter than one step is skipped, with a warning). The state counts phases from 1. Past the
last phase the loader stops with CurriculumComplete, unless allow_budget_mismatch=True (then the last
phase's mix goes on). Giving `total_tokens` (what the run will train) checks the curriculum's total
against it up front.

Exhaustion (seed 003). Each rank reads its own share of every bucket once (chunks rank, rank + W, ...).
A phase that demands more of a bucket than exists is caught before the run: validate() (and the
loader at start) treats it as a blocking error, or a warning with allow_bucket_exhaustion=True. If a
bucket still runs dry on some rank (the estimate was off: cropping, uneven shares), then
  - allow_bucket_exhaustion=False (default): the loader raises BucketExhausted carrying the last good
    state (the batch before). Under torch.distributed, the ranks agree on it with one tiny all_reduce
    per batch, so every rank raises at the same step and none is left hanging in a collective. The
    training script saves a checkpoint with that state and stops; resuming from it with the flag set
    continues with the bucket dropped.
  - allow_bucket_exhaustion=True: the bucket is dropped on that rank (a warning) and the other
    weights are renormalised.

The state (version 2, plain data) holds the phase, the tokens done (in the phase and in all), this
rank's position in the phase, the dropped buckets, and one best-fit loader state per bucket (so exact
and elastic resume work as for the other loaders; merge_states merges mixture states).

    python -m nanochat.mixture validate CONFIG --data DATA_DIR [--tokens N] [--split train]
"""

import argparse
import hashlib
import itertools
import json
import logging
import math
import os
import reprlib
import sys
import warnings
from typing import NamedTuple

import numpy as np
import torch

from nanochat import resume
from nanochat.dataloader import (DataLoader, _check_options, _DeviceBatches, _resolve_rank, _row_split,
                                 _shard_vocab, _ShardDocs, _ShardReader, _Source, _start_stream, _token_batches,
                                 _Tracker)
from nanochat.packing import BestFitPacker, check_long_doc_policy

logger = logging.getLogger(__name__)

PHI = (math.sqrt(5) - 1) / 2  # the golden ratio's fractional part: the most evenly spread steps on [0, 1)


class Phase(NamedTuple):
    tokens: int  # tokens the whole job trains in this phase
    mix: dict  # bucket -> weight, normalised to sum to 1


class MixtureStop(RuntimeError):
    """The mixture loader stopped on purpose; `state` is the last good state (resume from it)."""

    def __init__(self, message: str, state: dict | None):
        super().__init__(message)
        self.state = state


class BucketExhausted(MixtureStop):
    """A bucket ran dry on some rank (allow_bucket_exhaustion=False). Save a checkpoint with `.state`
    and stop; resume with allow_bucket_exhaustion=True to go on without the bucket."""

    def __init__(self, message: str, state: dict | None, bucket: str | None):
        super().__init__(message, state)
        self.bucket = bucket


class CurriculumComplete(MixtureStop):
    """Every phase's token budget has been trained (allow_budget_mismatch=False)."""


# -----------------------------------------------------------------------------
# Curricula and buckets


def list_buckets(data_dir: str, split: str) -> dict[str, list[str]]:
    """bucket name -> its .bin paths, for every subdirectory of data_dir/split holding .bin/.idx pairs."""
    from nanochat.pretokenize import list_token_shards
    split_dir = os.path.join(data_dir, split)
    if not os.path.isdir(split_dir):
        raise FileNotFoundError(f"{split_dir} does not exist: buckets are subdirectories {split_dir}/<bucket>/ of "
                                "pretokenized shards (python -m nanochat.pretokenize --output ...)")
    buckets = {}
    for name in sorted(os.listdir(split_dir)):
        if os.path.isdir(os.path.join(split_dir, name)):
            paths = [prefix + ".bin" for prefix in list_token_shards(os.path.join(split_dir, name))]
            if paths:
                buckets[name] = paths
    if not buckets:
        raise FileNotFoundError(f"no bucket in {split_dir}: expected subdirectories with .bin/.idx pairs")
    return buckets


def load_curriculum(spec, buckets=None) -> list[Phase]:
    """A curriculum from a YAML/JSON file path, a list of phases, or a dict with a "curriculum" list
    (seed 003's config shape, also under "data"). Each phase: {"tokens": n, "mix": {bucket: weight}}.
    Weights that do not sum to 1 are normalised with a warning; an unknown bucket (when `buckets` is
    given), a negative weight, an empty mix or a bad token count is a ValueError naming the phase."""
    source = "curriculum"
    if isinstance(spec, (str, os.PathLike)):
        path = source = os.fspath(spec)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"curriculum file {path} does not exist")
        with open(path) as f:
            text = f.read()
        import yaml
        try:  # JSON is YAML too, but its own parser gives the better message for a .json file
            spec = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as e:
            raise ValueError(f"{path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: {e}") from None
    if isinstance(spec, dict):
        if "curriculum" not in spec and isinstance(spec.get("data"), dict):
            spec = spec["data"]  # seed 003's config: data: {curriculum: [...]}
        if "curriculum" not in spec:
            raise ValueError(f"{source}: expected a list of phases, or a mapping with a 'curriculum' list")
        spec = spec["curriculum"]
    if not isinstance(spec, (list, tuple)) or not spec:
        raise ValueError(f"{source}: the curriculum must be a non-empty list of phases, got {spec!r}")
    phases = []
    for i, phase in enumerate(spec, 1):
        where = f"curriculum phase {i}"
        if not isinstance(phase, dict):
            raise ValueError(f"{where}: expected a mapping with 'tokens' and 'mix', got {phase!r}")
        unknown_keys = set(phase) - {"tokens", "duration_tokens", "mix"}
        if unknown_keys:
            raise ValueError(f"{where}: unknown keys {sorted(unknown_keys)} (a phase has 'tokens' and 'mix')")
        tokens = phase.get("tokens", phase.get("duration_tokens"))
        if isinstance(tokens, float) and tokens.is_integer():
            tokens = int(tokens)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"{where}: 'tokens' must be a positive integer, got {tokens!r}")
        mix = phase.get("mix")
        if not isinstance(mix, dict) or not mix:
            raise ValueError(f"{where}: empty mix; give {{bucket: weight, ...}}")
        for name, weight in mix.items():
            if buckets is not None and name not in buckets:
                raise ValueError(f"{where}: unknown bucket {name!r} (buckets: {', '.join(sorted(buckets))})")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"{where}: weight of {name!r} must be a number, got {weight!r}")
            if weight < 0:
                raise ValueError(f"{where}: weight of {name!r} is {weight}; weights must be >= 0")
        total = sum(mix.values())
        if total <= 0:
            raise ValueError(f"{where}: every weight is 0; give at least one bucket a positive weight")
        if abs(total - 1) > 1e-9:
            warnings.warn(f"{where}: weights sum to {total:g}, normalised to 1", stacklevel=2)
        phases.append(Phase(tokens, {name: mix[name] / total for name in sorted(mix) if mix[name] > 0}))
    return phases


def rank_shares(paths: list[str], chunk_size: int, world_size: int) -> list[int]:
    """Tokens each rank reads of a bucket (chunks rank, rank + W, ... of every file), from the .idx
    files only. With world_size 1: the bucket's size."""
    from nanochat.pretokenize import TokenShard
    shares = [0] * world_size
    for path in paths:
        offsets = TokenShard(path).offsets
        starts = np.arange(0, len(offsets) - 1, chunk_size)
        per_chunk = offsets[np.minimum(starts + chunk_size, len(offsets) - 1)] - offsets[starts]
        for rank in range(world_size):
            shares[rank] += int(per_chunk[rank::world_size].sum())
    return shares


def validate(curriculum, data_dir: str, split: str = "train", total_tokens: int | None = None,
             allow_bucket_exhaustion: bool = False, allow_budget_mismatch: bool = False,
             T: int | None = None, world_size: int = 1, chunk_size: int = 1024,
             step_tokens: int = 0) -> tuple[list[dict], list[str], list[str]]:
    """Tokens demanded versus available, per phase and bucket. Returns (rows, problems, warnings):
    problems block a run (a predicted shortfall, a budget mismatch), warnings do not (the same under
    their allow_* flag).
    - Demand counts trained tokens; with T given, a row of T+1 tokens per T trained. Cropping consumes
      more (long_doc_policy="split_reuse" does not), which the loader's run-time check catches.
    - With world_size W, each rank reads only its chunks of a bucket and draws about 1/W of the demand:
      the smallest rank share must cover demand / W.
    - total_tokens (what the run trains): a mismatch with the curriculum's total of one step
      (step_tokens) or more is a budget mismatch; accepted, a longer run extends the last phase, and
      its demand counts."""
    buckets = list_buckets(data_dir, split)
    phases = curriculum if isinstance(curriculum, list) and all(isinstance(p, Phase) for p in curriculum) \
        else load_curriculum(curriculum, buckets)
    shares = {name: rank_shares(paths, chunk_size, world_size) for name, paths in buckets.items()}
    scale = (T + 1) / T if T else 1.0
    total = sum(p.tokens for p in phases)
    budgets = [p.tokens for p in phases]
    rows, problems, notes = [], [], []
    if total_tokens is not None and abs(total_tokens - total) >= max(1, step_tokens):
        message = f"budget mismatch: the curriculum totals {total:,} tokens, the run will train {total_tokens:,}"
        (notes if allow_budget_mismatch else problems).append(message)
        if allow_budget_mismatch and total_tokens > total:
            budgets[-1] += total_tokens - total  # the last phase goes on
    demanded: dict[str, float] = dict.fromkeys(buckets, 0.0)
    for i, (phase, budget) in enumerate(zip(phases, budgets), 1):
        for name, weight in phase.mix.items():
            demand = budget * weight * scale
            demanded[name] += demand
            available, smallest = sum(shares[name]), min(shares[name])
            short = demanded[name] > available or demanded[name] / world_size > smallest
            rows.append({"phase": i, "bucket": name, "weight": weight, "demanded": round(demand),
                         "demanded_so_far": round(demanded[name]), "available": available,
                         "smallest_rank_share": smallest, "status": "SHORT" if short else "ok"})
            if short:
                where = (f"{available:,} available" if world_size == 1 else
                         f"{available:,} available, the smallest of {world_size} ranks' shares is {smallest:,}")
                message = (f"phase {i}: bucket {name!r} runs dry: {demanded[name]:,.0f} tokens demanded by the end "
                           f"of the phase, {where}")
                (notes if allow_bucket_exhaustion else problems).append(message)
    return rows, problems, notes


def _unit(seed: int, phase: int, generation: int) -> float:
    """The job's pseudo-random starting point on [0, 1) for a phase (blake2b of the three numbers)."""
    digest = hashlib.blake2b(f"{seed}:{phase}:{generation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def row_unit(seed: int, phase: int, generation: int, position: int, rank: int, world_size: int) -> float:
    """Where row `position` of `rank` in a phase falls on [0, 1): the job's rows share one golden-ratio
    sequence, indexed position * world_size + rank, so the rows of any run of consecutive steps (all
    ranks together) are one contiguous stretch of it, and the job's mix is as even as one rank's."""
    return (_unit(seed, phase, generation) + (position * world_size + rank) * PHI) % 1.0


def choose(weights: list[tuple[str, float]], u: float) -> str:
    """The bucket whose slice of [0, 1) holds u (weights in order, summing to 1)."""
    edge = 0.0
    for name, weight in weights:
        edge += weight
        if u < edge:
            return name
    return weights[-1][0]  # u within rounding of 1


# -----------------------------------------------------------------------------
# The loader


class _Lookahead:
    """An iterator that can tell whether it has another item (reading one ahead, on the same thread)."""

    def __init__(self, it):
        self._it, self._slot, self._done = it, None, False

    def more(self) -> bool:
        if self._slot is None and not self._done:
            try:
                self._slot = next(self._it)
            except StopIteration:
                self._done = True
        return self._slot is not None

    def __iter__(self):
        return self

    def __next__(self):
        if not self.more():
            raise StopIteration
        item, self._slot = self._slot, None
        return item


class _Bucket:
    """One bucket: its single-pass document stream, best-fit packer and state tracker."""

    def __init__(self, name, stream, tracker, packer, position, trace):
        self.name, self.stream, self.tracker, self.packer = name, stream, tracker, packer
        self.batches = _Lookahead(_token_batches(stream.batches(), tracker.encoder))
        self.source = _Source(self.batches, stream, position)
        self.trace = trace
        tracker.restore(packer)

    def _refill(self):
        return self.source() if self.batches.more() else ()  # nothing: the bucket is drained

    def _buffered_tokens(self) -> int:
        p = self.packer
        return p.tokens_in - (p.tokens_out - p.tokens_bos_added - p.tokens_repeated) - p.tokens_cropped

    def fill_row(self, row: np.ndarray, buffer_size: int) -> bool:
        """Pack one row (shape (1, T+1)); False if the bucket cannot fill it any more (dry)."""
        capacity = row.shape[1]
        while self._buffered_tokens() < capacity and self.batches.more():  # enough left to finish the row?
            for doc, key, overlap, start in self.source():
                self.packer.add(doc, key, overlap, start)
        if self._buffered_tokens() < capacity:
            return False
        self.packer.trace = [] if self.trace else None
        self.packer.fill(row, self._refill, buffer_size)
        return True


class _Mixture:
    """The curriculum's position, and the rows it draws from the buckets."""

    def __init__(self, phases, buckets, B, T, world_size, rank, seed, buffer_size, allow_bucket_exhaustion,
                 allow_budget_mismatch, config, start):
        self.phases, self.buckets = phases, buckets
        self.B, self.T, self.world_size, self.rank, self.seed = B, T, world_size, rank, seed
        self.buffer_size = buffer_size
        self.allow_bucket_exhaustion, self.allow_budget_mismatch = allow_bucket_exhaustion, allow_budget_mismatch
        self.config = config
        self.ends = list(itertools.accumulate(p.tokens for p in phases))  # where each phase ends, in job tokens
        s = start or {}
        self.tokens_done = s.get("tokens_done", 0)  # tokens the whole job has trained
        self.phase = s.get("phase", 1) - 1  # (the state counts phases from 1, as the messages do)
        self.phase_tokens_done = s.get("phase_tokens_done", 0)  # job tokens trained in this phase's batches
        self.position = s.get("position", 0)  # this rank's rows drawn in the phase
        self.generation = s.get("generation", 0)  # elastic merges so far: a fresh sequence after each
        self.dropped = set(s.get("dropped", []))
        emitted = s.get("emitted", {"batches": 0, "tokens": 0, "hash": resume.EMPTY_HASH})
        self.batches, self.emitted_tokens, self.hash = emitted["batches"], emitted["tokens"], emitted["hash"]
        self.past_end_warned = False

    def _phase_of(self, tokens_done: int) -> int | None:
        for p, end in enumerate(self.ends):
            if tokens_done < end:
                return p
        return None

    def state(self) -> dict:
        return _seal({
            "version": resume.VERSION, "loader": "mixture", "phase": self.phase + 1,
            "phase_tokens_done": self.phase_tokens_done, "tokens_done": self.tokens_done,
            "position": self.position, "generation": self.generation, "dropped": sorted(self.dropped),
            "buckets": {name: b.tracker.state(b.packer, b.source, np.empty(0, np.uint32))
                        for name, b in self.buckets.items()},
            "config": self.config,
            "emitted": {"batches": self.batches, "tokens": self.emitted_tokens, "hash": self.hash},
        })

    def stats(self, row_buckets) -> dict:
        per = {name: b.packer.stats() for name, b in self.buckets.items()}
        total = {key: sum(s[key] for s in per.values()) for key in
                 ("tokens_tokenized", "tokens_emitted", "tokens_cropped", "tokens_masked", "tokens_bos_added",
                  "tokens_repeated", "docs_split", "buffer_docs", "buffer_tokens")}
        out_docs = total["tokens_emitted"] - total["tokens_bos_added"] - total["tokens_repeated"]
        return total | {
            "crop_share": total["tokens_cropped"] / max(1, out_docs + total["tokens_cropped"]),
            "phase": self.phase + 1, "phase_tokens_done": self.phase_tokens_done, "tokens_done": self.tokens_done,
            "dropped": sorted(self.dropped), "row_buckets": row_buckets,
            "buckets": per,
        }

    def batches_(self):
        """Yield (rows, state, stats, extras) per batch; extras["stop"] is set (with the last good state
        as the state) when the loader must stop: ("bucket", name) or ("budget", None)."""
        B, T = self.B, self.T
        last_state = None
        while True:
            phase = self._phase_of(self.tokens_done)
            if phase is None:
                if not self.allow_budget_mismatch:
                    yield None, last_state, {}, {"stop": ("budget", None)}
                    return
                phase = len(self.phases) - 1
                if not self.past_end_warned:
                    self.past_end_warned = True
                    logger.warning("the curriculum's %s tokens are done; going on with the last phase's mix "
                                   "(allow_budget_mismatch=True)", f"{self.ends[-1]:,}")
            if phase != self.phase:
                if phase > self.phase + 1:
                    logger.warning("curriculum phases %s are shorter than one step (%s tokens) and were skipped",
                                   list(range(self.phase + 2, phase + 1)), f"{B * T * self.world_size:,}")
                self.phase, self.position, self.phase_tokens_done = phase, 0, 0
            rows = np.empty((B, T + 1), dtype=np.uint32)
            row_buckets, masked, trace = [], [], []
            for i in range(B):
                while True:
                    weights = self._weights(phase)
                    if not weights:  # every bucket of the phase ran dry on this rank
                        yield None, last_state, {}, {"stop": ("bucket", None)}
                        return
                    u = row_unit(self.seed, phase, self.generation, self.position, self.rank, self.world_size)
                    self.position += 1
                    name = choose(weights, u)
                    bucket = self.buckets[name]
                    if bucket.fill_row(rows[i:i + 1], self.buffer_size):
                        break
                    if not self.allow_bucket_exhaustion:
                        yield None, last_state, {}, {"stop": ("bucket", name)}
                        return
                    self.dropped.add(name)
                    logger.warning("bucket %r ran dry on rank %d in phase %d; dropped, the other weights "
                                   "renormalised (allow_bucket_exhaustion=True)", name, self.rank, phase + 1)
                row_buckets.append(name)
                masked += [(i, start, end) for _, start, end in bucket.packer.masked]
                if bucket.trace:
                    trace += [[(name, *key) if start is None else (name, *key, start) for key, start in row]
                              for row in bucket.packer.trace]
            self.tokens_done += B * T * self.world_size
            self.phase_tokens_done += B * T * self.world_size
            self.batches += 1
            self.emitted_tokens += rows.size
            self.hash = resume.hash_tokens(self.hash, rows)
            last_state = self.state()
            extras = {"trace": trace if trace else None, "masked": masked, "stop": None, "state": last_state}
            yield rows, last_state, self.stats(row_buckets), extras

    def _weights(self, phase: int) -> list[tuple[str, float]]:
        """The phase's weights without the dropped buckets, renormalised (empty: all of them dropped)."""
        mix = {name: w for name, w in self.phases[phase].mix.items() if name not in self.dropped}
        total = sum(mix.values())
        return [(name, w / total) for name, w in sorted(mix.items())]


_FLAG_GROUP: list = []  # the CPU (gloo) process group the stop flags travel on, made once


def _flag_group(world_size: int):
    """A gloo group for the per-batch stop flag, or None when the loader is not one of a job's ranks
    (no torch.distributed, or a loader made for world_size=1, e.g. an evaluation on rank 0 only). On
    CPU, so that reading the flag never waits for the GPU (an NCCL all_reduce + .item() would sync
    every step). Made at the first mixture loader's construction, which every rank reaches in the
    same order."""
    import torch.distributed as dist
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world_size:
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    if not _FLAG_GROUP:
        _FLAG_GROUP.append(dist.new_group(backend="gloo"))
    return _FLAG_GROUP[0]


def _checksum(state: dict) -> str:
    """A mixture state's checksum: its own fields, and each bucket state by that state's checksum (which
    covers the bucket's contents and is checked when the bucket resumes), so each batch's state is
    serialised once, not twice."""
    buckets = state.get("buckets")
    if not isinstance(buckets, dict) or not all(isinstance(b, dict) for b in buckets.values()):
        return ""
    return resume.checksum(dict(state, buckets={name: b.get("checksum") for name, b in buckets.items()}))


def _seal(state: dict) -> dict:
    state["checksum"] = _checksum(state)
    return state


def _agree(code: int, group) -> int:
    """The largest stop code over all ranks: one 4-byte all_reduce on the CPU group."""
    if group is None:
        return code
    import torch.distributed as dist
    flag = torch.tensor([code], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item())


class MixtureLoader(DataLoader):
    """The DataLoader of pretokenized_mixture_loader...: stops, on every rank at the same step, with
    BucketExhausted or CurriculumComplete. `stats` adds the phase, tokens done, dropped buckets,
    per-bucket statistics, and `row_buckets` (each row's bucket in the last batch)."""

    STOP_CODES = {None: 0, "budget": 1, "bucket": 2}
    FAILED = 3  # this rank's loader failed (a bad shard, ...): the others stop too instead of waiting

    def __init__(self, *args, start_state=None, world_size=1, **kwargs):
        super().__init__(*args, **kwargs)
        self.last_state = start_state
        # Looked up at each step, never kept: a loader held until the interpreter's exit (in a reference
        # cycle, or never closed) would keep a gloo group alive after destroy_process_group(), and its worker
        # thread then frees the flag tensors while Python is shutting down, which aborts the process.
        self._world_size = world_size
        _flag_group(world_size)  # made now, on every rank in the same order
        self._told_failure = False

    def __next__(self):
        try:
            return super().__next__()
        except MixtureStop:
            raise
        except Exception:
            if not self._told_failure:  # pair with the other ranks' flag exchange of this step
                self._told_failure = True
                _agree(self.FAILED, _flag_group(self._world_size))
            raise

    def _check(self, extras: dict) -> None:
        stop = extras.get("stop")
        code = _agree(self.STOP_CODES[stop[0] if stop else None], _flag_group(self._world_size))
        if not code:
            self.last_state = extras["state"]
        if code == self.FAILED:
            self._told_failure = True
            raise RuntimeError("the mixture loader failed on another rank (see its error); stopping here too")
        if code == 2:
            if stop and stop[1]:
                where = f"bucket {stop[1]!r} ran dry on this rank"
            elif stop:
                where = "every bucket of the current phase ran dry on this rank"
            else:
                where = "a bucket ran dry on another rank"
            raise BucketExhausted(f"{where}; its `state` is the last good state: save a checkpoint with it and "
                                  "stop, or resume with allow_bucket_exhaustion=True to drop the bucket",
                                  self.last_state, stop[1] if stop else None)
        if code == 1:
            raise CurriculumComplete("every phase of the curriculum is done; its `state` is the last good state "
                                     "(pass allow_budget_mismatch=True to go on with the last phase)", self.last_state)


def pretokenized_mixture_loader_with_state_bos_bestfit(
        B: int, T: int, split: str, curriculum, device="cuda", resume_state_dict: dict | None = None,
        buffer_size: int = 1000, *, data_dir: str, seed: int = 0, bos_token: int | None = None,
        chunk_size: int = 1024, batch_size: int = 128, rank: int | None = None, world_size: int | None = None,
        prefetch: int = 4, with_state: bool = True, allow_state_mismatch: bool = False,
        allow_bucket_exhaustion: bool = False, allow_budget_mismatch: bool = False,
        total_tokens: int | None = None, trace_documents: bool = False, long_doc_policy: str = "crop",
        split_overlap: int = 0, vocab_size: int | None = None) -> MixtureLoader:
    """Yield (inputs, targets, state_dict): best-fit rows, each from one bucket of data_dir/split/<bucket>/,
    mixed by the curriculum (see the module docstring). buffer_size is per bucket. seed picks the mix's
    sequence. total_tokens: tokens the run will train (all ranks), checked against the curriculum.
    vocab_size: as for the pretokenized loader; pretokenize.json is looked for in data_dir and in each
    bucket's directory.
    Raises BucketExhausted / CurriculumComplete (with .state, the last good state) where it must stop."""
    _check_options(B, T, split, prefetch, buffer_size=buffer_size, chunk_size=chunk_size, batch_size=batch_size)
    check_long_doc_policy(long_doc_policy, split_overlap, T)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    rank, world_size = _resolve_rank(rank, world_size)
    paths = list_buckets(data_dir, split)
    phases = load_curriculum(curriculum, paths)
    # the vocabulary: vocab_size, or pretokenize.json in data_dir or in a bucket's directory (all agree)
    vocab = _shard_vocab(next(iter(paths.values()))[0], bos_token, vocab_size,
                         [data_dir] + [os.path.join(data_dir, split, name) for name in paths])
    bos_token = vocab[0]
    used = sorted({name for p in phases for name in p.mix})
    config = {"loader": "mixture", "source": "pretokenized", "split": split,
              "buckets": {name: resume.files_fingerprint(paths[name]) for name in used},
              "chunk_size": chunk_size, "B": B, "T": T, "buffer_size": buffer_size, "tokenizer_batch_size": batch_size,
              "tokenizer": f"bos:{bos_token}", "seed": seed,
              "curriculum": [[p.tokens, [[name, w] for name, w in sorted(p.mix.items())]] for p in phases],
              "rank": rank, "world_size": world_size, "long_doc_policy": long_doc_policy,
              "split_overlap": split_overlap}
    state, where = _mixture_start(resume_state_dict, config, rank, world_size, allow_state_mismatch)
    if state is None:  # a fresh run: refuse a curriculum that is predicted to run dry
        _, problems, notes = validate(phases, data_dir, split, total_tokens, allow_bucket_exhaustion,
                                      allow_budget_mismatch, T, world_size, chunk_size, B * T * world_size)
        for note in notes:
            logger.warning("mixture: %s", note)
        if problems:
            raise ValueError("the curriculum does not fit the data: " + "; ".join(problems) +
                             " (python -m nanochat.mixture validate prints the whole table; "
                             "allow_bucket_exhaustion / allow_budget_mismatch accept it)")
    elif (total_tokens is not None and abs(total_tokens - sum(p.tokens for p in phases)) >= B * T * world_size
          and not allow_budget_mismatch):
        raise ValueError(f"budget mismatch: the curriculum totals {sum(p.tokens for p in phases):,} tokens, "
                         f"the run will train {total_tokens:,}; pass allow_budget_mismatch=True to accept it")
    encoder = _ShardDocs(bos_token)
    buckets = {}
    for name in used:
        sub_config = {"loader": "bestfit", "source": "pretokenized", "split": f"{split}/{name}",
                      "files": config["buckets"][name], "num_files": len(paths[name]), "chunk_size": chunk_size,
                      "B": B, "T": T, "buffer_size": buffer_size, "tokenizer_batch_size": batch_size,
                      "tokenizer": config["tokenizer"], "rank": rank, "world_size": world_size,
                      "long_doc_policy": long_doc_policy, "split_overlap": split_overlap}
        sub_state = state["buckets"][name] if state else None
        reader = _ShardReader(paths[name], chunk_size, vocab)
        stream, start, position = _start_stream(reader, rank, world_size, batch_size, sub_state, sub_config,
                                                allow_state_mismatch, epochs=1, where=f"{where}['buckets'][{name!r}]")
        tracker = _Tracker("bestfit", stream, encoder, sub_config, start)
        packer = BestFitPacker(T + 1, long_doc_policy, split_overlap)
        buckets[name] = (stream, tracker, packer, position)

    def batches():
        made = {name: _Bucket(name, *parts, trace_documents) for name, parts in buckets.items()}
        mixture = _Mixture(phases, made, B, T, world_size, rank, seed, buffer_size, allow_bucket_exhaustion,
                           allow_budget_mismatch, config, state)
        yield from mixture.batches_()

    return MixtureLoader(batches(), _DeviceBatches(B, T, device), _row_split, prefetch, with_state,
                         start_state=state, world_size=world_size)


def pretokenized_mixture_loader_bos_bestfit(*args, **kwargs):
    """Like pretokenized_mixture_loader_with_state_bos_bestfit, yielding (inputs, targets)."""
    return pretokenized_mixture_loader_with_state_bos_bestfit(*args, with_state=False, **kwargs)


def _mixture_start(state, config, rank, world_size, allow_mismatch) -> tuple[dict | None, str]:
    """Validate a mixture resume state (or a merge of them) against this loader; returns this rank's, and
    what messages call it (its bucket states are checked when each bucket resumes)."""
    where = "resume_state_dict"
    if state is None:
        return None, where
    if not isinstance(state, dict):
        raise TypeError(f"resume_state_dict must be a dict, got {type(state).__name__}")
    if "merged" in state:
        state, where = resume.rank_state(state, rank, world_size)
    if state.get("version") != resume.VERSION or state.get("loader") != "mixture":
        raise ValueError(f"{where} is not a mixture loader state (version 2, loader 'mixture')")
    resume._fields(state, where, FIELDS, ())
    if not resume.intact(state, where, _checksum) and not allow_mismatch:
        raise ValueError(f"{where}['checksum'] does not match its contents: the state was edited or "
                         "corrupted; pass allow_state_mismatch=True to resume from it anyway")
    _check_fields(state, where)
    saved = state["config"]
    differ = [f"{k}: state {saved.get(k)!r}, loader {v!r}" for k, v in config.items() if saved.get(k) != v]
    stream_fields = ("source", "split", "buckets", "chunk_size", "tokenizer", "rank", "world_size")
    if differ and (not allow_mismatch or any(saved.get(k) != config[k] for k in stream_fields)):
        raise ValueError(f"{where} was taken on another configuration (" + "; ".join(differ) + ")" +
                         ("" if allow_mismatch else "; pass allow_state_mismatch=True to go on with a changed "
                          "curriculum, seed, B, T or buffer size"))
    return state, where


FIELDS = ("version", "loader", "phase", "phase_tokens_done", "tokens_done", "position", "generation", "dropped",
          "buckets", "config", "emitted", "checksum")
CONFIG_FIELDS = ("loader", "source", "split", "buckets", "chunk_size", "B", "T", "buffer_size", "tokenizer_batch_size",
                 "tokenizer", "seed", "curriculum", "rank", "world_size", "long_doc_policy", "split_overlap")


def _check_fields(state: dict, where: str) -> None:
    """Check every field of a mixture state but its bucket states (checked when each bucket resumes, or
    by merge_states): a ValueError naming the field."""
    config = resume._fields(state["config"], f"{where}['config']", CONFIG_FIELDS, ())
    names = resume._fields(config["buckets"], f"{where}['config']['buckets']", ())
    for name, files in names.items():
        resume._hex(files, f"{where}['config']['buckets'][{name!r}]")
    for key in ("chunk_size", "B", "T", "buffer_size", "tokenizer_batch_size", "world_size"):
        resume._int(config[key], f"{where}['config'][{key!r}]", 1)
    if resume._int(config["rank"], f"{where}['config']['rank']") >= config["world_size"]:
        raise ValueError(f"{where}['config']['rank'] is {config['rank']}, but world_size is {config['world_size']}")
    phases = resume._list(config["curriculum"], f"{where}['config']['curriculum']")
    for i, phase in enumerate(phases):
        if not (isinstance(phase, list) and len(phase) == 2 and resume._is_int(phase[0]) and phase[0] >= 1
                and isinstance(phase[1], list)
                and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and p[0] in names
                        for p in phase[1])):
            raise ValueError(f"{where}['config']['curriculum'][{i}] must be [tokens, [[bucket, weight], ...]]")
    resume._int(state["phase"], f"{where}['phase']", 1)
    if state["phase"] > len(phases):
        raise ValueError(f"{where}['phase'] is {state['phase']}, but the curriculum has {len(phases)} phases")
    resume._int(state["tokens_done"], f"{where}['tokens_done']")
    if resume._int(state["phase_tokens_done"], f"{where}['phase_tokens_done']") > state["tokens_done"]:
        raise ValueError(f"{where}['phase_tokens_done'] is {state['phase_tokens_done']}, more than "
                         f"tokens_done {state['tokens_done']}")
    resume._int(state["position"], f"{where}['position']")
    resume._int(state["generation"], f"{where}['generation']")
    dropped = resume._list(state["dropped"], f"{where}['dropped']")
    if not all(isinstance(name, str) and name in names for name in dropped) or len(set(dropped)) != len(dropped):
        raise ValueError(f"{where}['dropped'] must list buckets of the mixture ({', '.join(names)}) once each, got "
                         f"{reprlib.repr(dropped)}")
    buckets = resume._fields(state["buckets"], f"{where}['buckets']", names, ())
    for name, bucket in buckets.items():
        resume._fields(bucket, f"{where}['buckets'][{name!r}]", ())
    resume._check_emitted(state["emitted"], f"{where}['emitted']")


def merge_mixture_states(states: list[dict], world_size: int, *, data_dir: str) -> dict:
    """Merge the mixture states of all N ranks at one step into the resume state of M ranks: every
    bucket's remaining documents are dealt by resume.merge_states; the phase and tokens done carry over,
    and the new ranks start a fresh mix sequence (generation + 1). A bucket stays dropped only if every
    old rank had dropped it."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    for i, s in enumerate(states):
        if not isinstance(s, dict) or s.get("loader") != "mixture" or s.get("version") != resume.VERSION:
            raise ValueError(f"states[{i}] is not a mixture loader state (version 2, loader 'mixture')")
        resume._fields(s, f"states[{i}]", FIELDS, ())
        if not resume.intact(s, f"states[{i}]", _checksum):
            raise ValueError(f"states[{i}]['checksum'] does not match its contents (edited or corrupted)")
        _check_fields(s, f"states[{i}]")
    first = states[0]
    for i, s in enumerate(states):
        for key in ("tokens_done", "phase", "generation"):
            if s[key] != first[key]:
                raise ValueError(f"{key}: states[{i}] has {s[key]!r}, states[0] has {first[key]!r}; merge states "
                                 "of one step")
        if {k: v for k, v in s["config"].items() if k != "rank"} != {k: v for k, v in first["config"].items()
                                                                     if k != "rank"}:
            raise ValueError(f"config: states[{i}] was taken on another configuration than states[0]")
    per_bucket = {name: resume._merge_states([s["buckets"][name] for s in states], world_size, data_dir, 1,
                                             [f"states[{i}]['buckets'][{name!r}]" for i in range(len(states))])
                  for name in first["buckets"]}
    dropped = sorted(set.intersection(*(set(s["dropped"]) for s in states)))
    merged = []
    for q in range(world_size):
        merged.append(_seal({
            "version": resume.VERSION, "loader": "mixture", "phase": first["phase"],
            "phase_tokens_done": first["phase_tokens_done"], "tokens_done": first["tokens_done"], "position": 0,
            "generation": first["generation"] + 1, "dropped": dropped,
            "buckets": {name: m["states"][q] for name, m in per_bucket.items()},
            "config": dict(first["config"], rank=q, world_size=world_size),
            "emitted": {"batches": first["emitted"]["batches"], "tokens": 0, "hash": resume.EMPTY_HASH},
        }))
    return {"version": resume.VERSION, "merged": {"from_world_size": len(states), "world_size": world_size},
            "states": merged}


# -----------------------------------------------------------------------------
# python -m nanochat.mixture validate CONFIG --data PATH [--tokens N]


def _positive(text: str) -> int:
    value = int(text.replace("_", ""))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanochat.mixture",
                                     description="Check a curriculum against the buckets on disk.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("validate", help="tokens demanded vs available per phase and bucket; exit 1 on a "
                                            "blocking problem")
    check.add_argument("config", help="curriculum file (.yaml/.yml/.json): a list of phases or {curriculum: [...]}")
    check.add_argument("--data", required=True, help="the data directory holding <split>/<bucket>/ shards")
    check.add_argument("--split", default="train", choices=["train", "val"])
    check.add_argument("--tokens", type=_positive, default=None, help="tokens the run will train (all ranks)")
    check.add_argument("--T", type=_positive, default=None, help="the loader's T: a row of T+1 tokens trains T")
    check.add_argument("--B", type=_positive, default=None, help="the loader's B (with --T: the step, the budget's "
                                                                  "tolerance)")
    check.add_argument("--world-size", type=_positive, default=1, help="ranks: each must hold its share (default 1)")
    check.add_argument("--chunk-size", type=_positive, default=1024, help="the loader's chunk_size (default 1024)")
    check.add_argument("--allow-bucket-exhaustion", action="store_true", help="a predicted shortfall only warns")
    check.add_argument("--allow-budget-mismatch", action="store_true", help="a budget mismatch only warns")
    args = parser.parse_args(argv)
    try:
        step = args.B * args.T * args.world_size if args.B and args.T else 0
        rows, problems, notes = validate(args.config, args.data, args.split, args.tokens,
                                         args.allow_bucket_exhaustion, args.allow_budget_mismatch, args.T,
                                         args.world_size, args.chunk_size, step)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    per_rank = args.world_size > 1
    print(f"{'phase':>5s}  {'bucket':16s} {'weight':>7s} {'demanded':>16s} {'demanded so far':>16s} "
          f"{'available':>16s}" + (f" {'smallest rank share':>20s}" if per_rank else "") + "  status")
    for r in rows:
        print(f"{r['phase']:5d}  {r['bucket']:16s} {r['weight']:7.3f} {r['demanded']:16,d} {r['demanded_so_far']:16,d} "
              f"{r['available']:16,d}" + (f" {r['smallest_rank_share']:20,d}" if per_rank else "") + f"  {r['status']}")
    for note in notes:
        print(f"warning: {note}")
    for problem in problems:
        print(f"error: {problem}")
    print("blocking problems: " + (str(len(problems)) if problems else "none"))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())

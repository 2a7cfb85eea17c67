"""
Curricula and buckets: what a mixture reads (GPT-Simple's layout and rules).
A curriculum is an ordered list of phases, each a token budget and a mix of bucket weights; buckets
are the subdirectories of a pretokenized data directory. validate() sets the tokens each phase
demands of each bucket against what the buckets (and each rank's share of them) hold, less the
estimated crop; row_unit() and choose() pick the bucket of each row of each rank. `python -m
nanochat.mixture validate` prints validate()'s table; the draw itself is mix.py.

Design: docs/mixtures.md

May import: nanochat.data.base.checks, nanochat.data.base.shuffle, nanochat.data.base.packing,
nanochat.data.pretokenized.token_shards, nanochat.data.base.layout, pyyaml, numpy.
"""

import hashlib
import json
import math
import os
import warnings
from typing import NamedTuple

import numpy as np
import yaml

from nanochat.data.base.checks import is_int
from nanochat.data.base.layout import check_kind, list_token_shards
from nanochat.data.base.packing import POLICIES
from nanochat.data.base.shuffle import Shuffle
from nanochat.data.pretokenized.token_shards import TokenShard

# the golden ratio's fractional part: the most evenly spread steps on [0, 1)
PHI = (math.sqrt(5) - 1) / 2


class Phase(NamedTuple):
    tokens: int  # tokens the whole job trains in this phase
    mix: dict  # bucket -> weight, normalised to sum to 1


# -----------------------------------------------------------------------------
# Curricula and buckets


def list_buckets(data_dir: str, split: str) -> dict[str, list[str]]:
    """bucket name -> its .bin paths, for every subdirectory of data_dir/split holding .bin/.idx
    pairs. When there is none: ValueError if data_dir holds another kind of data (parquet shards, a
    plain pretokenize output, ...), else FileNotFoundError."""
    data_dir = os.path.expanduser(os.fspath(data_dir))
    split_dir = os.path.join(data_dir, split)
    buckets = {}
    for name in sorted(os.listdir(split_dir)) if os.path.isdir(split_dir) else []:
        if os.path.isdir(os.path.join(split_dir, name)):
            paths = [prefix + ".bin" for prefix in list_token_shards(os.path.join(split_dir, name))]
            if paths:  # an empty directory is no bucket: a mix naming it fails by name
                buckets[name] = paths
    if buckets:
        return buckets
    check_kind(data_dir, "buckets")  # another kind of data: a ValueError that says which
    command = f"python -m nanochat.pretokenize --input ... --output {data_dir} --bucket NAME"
    if not os.path.isdir(split_dir):
        raise FileNotFoundError(f"{split_dir} does not exist: buckets are subdirectories "
                                f"{split_dir}/<bucket>/ of .bin/.idx pairs; write each with "
                                f"{command}")
    raise FileNotFoundError(f"no bucket in {split_dir}: expected subdirectories with .bin/.idx "
                            f"pairs; write each with {command}")


def load_curriculum(spec, buckets=None) -> list[Phase]:
    """A curriculum from a YAML/JSON file path, a list of phases, or a dict with a "curriculum" list
    (GPT-Simple's config shape, also under "data"). Each phase: {"tokens": n, "mix": {bucket:
    weight}}. Weights that do not sum to 1 are normalised with a warning; an unknown bucket (when
    `buckets` is given), a negative weight, an empty mix or a bad token count is a ValueError naming
    the phase."""
    spec, source = _read_spec(spec)
    if isinstance(spec, dict):
        if "curriculum" not in spec and isinstance(spec.get("data"), dict):
            spec = spec["data"]  # GPT-Simple's config: data: {curriculum: [...]}
        if "curriculum" not in spec:
            raise ValueError(f"{source}: expected a list of phases, or a mapping with a "
                             "'curriculum' list")
        spec = spec["curriculum"]
    if not isinstance(spec, (list, tuple)) or not spec:
        raise ValueError(f"{source}: the curriculum must be a non-empty list of phases, got "
                         f"{spec!r}")
    phases = []
    for i, phase in enumerate(spec, 1):  # (a loop, not a comprehension: see _phase's warning)
        phases.append(_phase(f"curriculum phase {i}", phase, buckets))  # named from 1
    return phases


def _read_spec(spec) -> tuple:
    """(the curriculum as given or as its file holds it, what messages call it)."""
    if not isinstance(spec, (str, os.PathLike)):
        return spec, "curriculum"
    path = os.path.expanduser(os.fspath(spec))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"curriculum file {path} does not exist")
    with open(path) as f:
        text = f.read()
    try:  # JSON is YAML too, but its own parser gives the better message for a .json file
        return (json.loads(text) if path.endswith(".json") else yaml.safe_load(text)), path
    except (ValueError, yaml.YAMLError) as e:
        kind = "JSON" if path.endswith(".json") else "YAML"
        raise ValueError(f"{path} is not valid {kind}: {e}") from None


def _phase(label: str, phase, buckets) -> Phase:
    """One phase of a curriculum, checked (label: what messages call it)."""
    if not isinstance(phase, dict):
        raise ValueError(f"{label}: expected a mapping with 'tokens' and 'mix', got {phase!r}")
    unknown_keys = set(phase) - {"tokens", "duration_tokens", "mix"}
    if unknown_keys:
        raise ValueError(f"{label}: unknown keys {sorted(unknown_keys)} (a phase has 'tokens' "
                         "and 'mix')")
    tokens = phase.get("tokens", phase.get("duration_tokens"))  # GPT-Simple's name too
    if isinstance(tokens, float) and tokens.is_integer():  # YAML reads 5e9 as a float
        tokens = int(tokens)
    # is_int, not check_int: the message names the phase and says "positive"
    if not is_int(tokens) or tokens < 1:
        raise ValueError(f"{label}: 'tokens' must be a positive integer, got {tokens!r}")
    mix = phase.get("mix")
    if not isinstance(mix, dict) or not mix:
        raise ValueError(f"{label}: empty mix; give {{bucket: weight, ...}}")
    for name, weight in mix.items():
        if buckets is not None and name not in buckets:
            raise ValueError(f"{label}: unknown bucket {name!r} (buckets: "
                             f"{', '.join(sorted(buckets))})")
        # a weight is any finite number; True would slip through as 1
        if (isinstance(weight, bool) or not isinstance(weight, (int, float))
                or not math.isfinite(weight)):
            raise ValueError(f"{label}: weight of {name!r} must be a number, got {weight!r}")
        if weight < 0:
            raise ValueError(f"{label}: weight of {name!r} is {weight}; weights must be >= 0")
    total = sum(mix.values())
    if total <= 0:
        raise ValueError(f"{label}: every weight is 0; give at least one bucket a positive "
                         "weight")
    if abs(total - 1) > 1e-9:  # 1e-9: 0.7 + 0.1 + 0.1 + 0.1 is not exactly 1 in floats
        # stacklevel 3: the warning points at load_curriculum's caller
        warnings.warn(f"{label}: weights sum to {total:g}, normalised to 1", stacklevel=3)
    # sorted and without zero weights: the mix's order decides choose(), whatever the file's
    return Phase(tokens, {name: mix[name] / total for name in sorted(mix) if mix[name] > 0})


class Shares(NamedTuple):
    """What each rank reads of a bucket: its entry tokens, and those its rows can take."""
    tokens: list[int]
    usable: list[int]  # after the estimated crop (bucket_shares)


def _chunk_sums(offsets: np.ndarray, chunk_size: int) -> np.ndarray:
    """Tokens per chunk of a file's entries, from its offsets."""
    starts = np.arange(0, len(offsets) - 1, chunk_size)
    # the last chunk of a file may be shorter: its end is the file's last offset
    return offsets[np.minimum(starts + chunk_size, len(offsets) - 1)] - offsets[starts]


def _deal(chunks: list[np.ndarray], world_size: int, shuffle: Shuffle | None) -> list[int]:
    """Tokens per rank of per-file chunk sums: chunks rank, rank + W, ... of every file; shuffled:
    of the first epoch's permutation of all chunks."""
    if shuffle:
        tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
        return [int(tokens[shuffle.units(1, len(tokens), rank, world_size)].sum())
                for rank in range(world_size)]
    return [sum(int(c[rank::world_size].sum()) for c in chunks) for rank in range(world_size)]


def bucket_shares(paths: list[str], chunk_size: int, world_size: int, shuffle: Shuffle | None,
                  T: int | None, long_doc_policy: str) -> Shares:
    """Tokens each rank reads of a bucket, and an estimate of those its rows can take, from the .idx
    files only (one read each). Under "crop" a document longer than a row (T+1 tokens) keeps one
    row's worth at most: its tail is cropped away. Shorter documents are counted whole, though
    best-fit crops some of them too, so `usable` is an upper bound on what rows take (and the
    estimate a lower bound on the crop). "split" and "split_reuse" use every token (their added BOS
    and repeated overlap are not counted); so does an unknown T."""
    capacity = T + 1 if T and long_doc_policy == "crop" else None
    tokens, usable = [], []
    for path in paths:
        offsets = TokenShard(path).offsets  # the index only: the tokens stay unread
        tokens.append(_chunk_sums(offsets, chunk_size))
        if capacity is not None:  # the offsets of the entries cut to one row each
            kept = np.concatenate(([0], np.cumsum(np.minimum(np.diff(offsets), capacity))))
            usable.append(_chunk_sums(kept, chunk_size))
    shares = _deal(tokens, world_size, shuffle)
    return Shares(shares, _deal(usable, world_size, shuffle) if capacity is not None else shares)


def rank_shares(paths: list[str], chunk_size: int, world_size: int,
                shuffle: Shuffle | None = None) -> list[int]:
    """Tokens each rank reads of a bucket (chunks rank, rank + W, ... of every file; shuffled: of
    the first epoch's permutation of all chunks), from the .idx files only. With world_size 1: the
    bucket's size."""
    return bucket_shares(paths, chunk_size, world_size, shuffle, None, "crop").tokens


MORE_DATA = "give the bucket a lower weight or more data"  # the fix when cropping is not the cause


def dry_fixes(T: int | None, long_doc_policy: str) -> str:
    """What to do about a bucket that runs dry (validate's and BucketExhausted's messages end with
    it)."""
    fixes = [MORE_DATA]
    if long_doc_policy == "crop":  # the crop is what a split policy or windows save
        window = T + 1 if T else "T+1"
        fixes[:0] = ['long_doc_policy="split" (long documents in pieces, not cropped)',
                     f"pretokenize the bucket in windows (--max-length {window})"]
    return "; or ".join(fixes)


class _Supply(NamedTuple):
    """A bucket's tokens against what it must supply: all ranks, and the smallest rank's share."""
    available: int  # entry tokens, all ranks
    smallest: int  # the smallest rank's share of them
    usable: int  # what rows can take, after the estimated crop (bucket_shares)
    smallest_usable: int
    crop_share: float | None  # the estimated crop, 1 - usable / available; None: no T

    def short(self, demand: float, world_size: int, usable: bool) -> bool:
        """Whether demand (all ranks) is more than the bucket holds (usable: more than its rows can
        take). Every rank draws about 1/W of the demand, so the smallest share runs dry first."""
        total, smallest = ((self.usable, self.smallest_usable) if usable
                           else (self.available, self.smallest))
        return demand > total or demand / world_size > smallest


def validate(curriculum, data_dir: str, split: str = "train", *, total_tokens: int | None = None,
             allow_bucket_exhaustion: bool = False, allow_budget_mismatch: bool = False,
             T: int | None = None, world_size: int = 1, chunk_size: int = 1024,
             step_tokens: int = 0, shuffle: Shuffle | None = None, long_doc_policy: str = "crop",
             strict: bool = False) -> tuple[list[dict], list[str], list[str]]:
    """Tokens demanded versus available, per phase and bucket. Returns (lines, problems, warnings):
    problems block a run (a predicted shortfall, a budget mismatch), warnings do not (the same under
    their allow_* flag).
    - Demand counts trained tokens; with T given, a row of T+1 tokens per T trained.
    - With T given, under long_doc_policy="crop", each bucket's crop is estimated (bucket_shares).
      A bucket whose tokens cover the demand but whose usable tokens do not is a warning, once per
      bucket, naming the step where it runs dry (with step_tokens) and the fixes; strict=True makes
      it a problem (unless allow_bucket_exhaustion).
    - With world_size W, each rank reads only its chunks of a bucket and draws about 1/W of the
      demand: the smallest rank share must cover demand / W.
    - total_tokens (what the run trains): a mismatch with the curriculum's total of one step
      (step_tokens) or more is a budget mismatch; accepted, a longer run extends the last phase, and
      its demand counts.
    - shuffle: the loader's order (each bucket's own, by its name), which deals other chunks to each
      rank."""
    if long_doc_policy not in POLICIES:
        raise ValueError(f"long_doc_policy must be one of {POLICIES}, got {long_doc_policy!r}")
    buckets = list_buckets(data_dir, split)
    loaded = isinstance(curriculum, list) and all(isinstance(p, Phase) for p in curriculum)
    phases = curriculum if loaded else load_curriculum(curriculum, buckets)
    supply = {name: _supply(paths, chunk_size, world_size, shuffle and shuffle.bucket(name), T,
                            long_doc_policy) for name, paths in buckets.items()}
    scale = (T + 1) / T if T else 1.0  # a row of T + 1 tokens trains T: the last is a target only
    lines, problems, notes = [], [], []
    budgets = _budgets(phases, total_tokens, step_tokens, allow_budget_mismatch,
                       notes if allow_budget_mismatch else problems)
    demanded: dict[str, float] = dict.fromkeys(buckets, 0.0)
    told: dict[str, str] = {}  # bucket -> the status its message told ("SHORT" or "CROP")
    phase_start = 0  # job tokens trained before the phase
    for i, (phase, budget) in enumerate(zip(phases, budgets), 1):
        for name, weight in phase.mix.items():
            s = supply[name]
            demand = budget * weight * scale
            demanded[name] += demand  # a bucket is read once across phases: demand accumulates
            short = s.short(demanded[name], world_size, usable=False)
            dry = short or s.short(demanded[name], world_size, usable=True)
            status = "SHORT" if short else "CROP" if dry else "ok"
            lines.append({"phase": i, "bucket": name, "weight": weight, "demanded": round(demand),
                         "demanded_so_far": round(demanded[name]), "available": s.available,
                         "smallest_rank_share": s.smallest, "usable": s.usable,
                         "smallest_rank_usable": s.smallest_usable, "crop_share": s.crop_share,
                         "status": status})
            if not dry or told.get(name) in (status, "SHORT"):
                continue  # once per bucket and kind: demand only grows
            told[name] = status
            # where it runs dry: the job token at which the demand passes what rows can take
            can_take = min(s.usable, world_size * s.smallest_usable)
            before = demanded[name] - demand  # demand of the earlier phases
            dry_at = phase_start + max(0.0, can_take - before) / (weight * scale)
            message = _dry_message(i, name, demanded[name], s, short, world_size=world_size, T=T,
                                   long_doc_policy=long_doc_policy,
                                   when=_when(dry_at, step_tokens, sum(budgets)))
            blocking = (short or strict) and not allow_bucket_exhaustion
            (problems if blocking else notes).append(message)
        phase_start += budget
    return lines, problems, notes


def _supply(paths: list[str], chunk_size: int, world_size: int, shuffle: Shuffle | None,
            T: int | None, long_doc_policy: str) -> _Supply:
    """A bucket's tokens, all ranks and the smallest rank's share, before and after the crop."""
    shares, usable = bucket_shares(paths, chunk_size, world_size, shuffle, T, long_doc_policy)
    crop = 1 - sum(usable) / max(1, sum(shares)) if T else None
    return _Supply(sum(shares), min(shares), sum(usable), min(usable), crop)


def _budgets(phases: list[Phase], total_tokens: int | None, step_tokens: int,
             allow_budget_mismatch: bool, said: list[str]) -> list[int]:
    """Each phase's tokens; a mismatch with total_tokens is said (appended to said), and when it is
    accepted, a longer run extends the last phase."""
    total = sum(p.tokens for p in phases)
    budgets = [p.tokens for p in phases]
    # within one step is no mismatch: a run trains whole steps
    if total_tokens is not None and abs(total_tokens - total) >= max(1, step_tokens):
        said.append(f"budget mismatch: the curriculum totals {total:,} tokens, the run will train "
                    f"{total_tokens:,}")
        if allow_budget_mismatch and total_tokens > total:
            budgets[-1] += total_tokens - total  # the last phase goes on
    return budgets


def _when(dry_at: float, step_tokens: int, total: int) -> str:
    """Where a bucket runs dry: "step N of M" (1-based), or the job tokens when the step is
    unknown."""
    if not step_tokens:
        return f"after about {dry_at:,.0f} tokens of the job's {total:,}"
    steps = -(-total // step_tokens)  # a step trained from below the total is the last one
    # step k trains job tokens [(k - 1) S, k S): the first whose demand passes the supply
    # (1e-9: 39,600 tokens at 396 a step is the end of step 100, not 99.99...)
    step = int(dry_at / step_tokens + 1e-9) + 1
    return f"at about step {min(steps, step):,} of {steps:,}"


def _dry_message(phase: int, name: str, demanded: float, s: _Supply, short: bool, *,
                 world_size: int, T: int | None, long_doc_policy: str, when: str) -> str:
    """validate's message for a bucket that runs dry: where, the tokens, the crop, the fixes.
    short: it lacks entry tokens, not only usable ones (less cropping would not be enough)."""
    label = (f"{s.available:,} available" if world_size == 1 else
             f"{s.available:,} available, the smallest of {world_size} ranks' shares is "
             f"{s.smallest:,}")
    message = (f"phase {phase}: bucket {name!r} runs dry {when}: {demanded:,.0f} tokens demanded "
               f"by the end of the phase, {label}")
    # (the crop, unless it is too small to matter to a bucket short of tokens)
    if long_doc_policy == "crop" and s.crop_share is not None and (
            not short or s.crop_share >= 0.005):
        usable = (f"{s.usable:,}" if world_size == 1 else
                  f"{s.usable:,} (the smallest rank's {s.smallest_usable:,})")
        message += (f"; rows can take about {usable} of them: an estimated crop share of "
                    f"{s.crop_share:.2f} (long_doc_policy={long_doc_policy!r}, T={T})")
    return f"{message}; fixes: {MORE_DATA if short else dry_fixes(T, long_doc_policy)}"


def _unit(seed: int, phase: int, generation: int) -> float:
    """The job's pseudo-random starting point on [0, 1) for a phase (blake2b of the three
    numbers)."""
    # blake2b, not hash(): the same on every rank and run (str hashes are salted per process)
    digest = hashlib.blake2b(f"{seed}:{phase}:{generation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def row_unit(seed: int, phase: int, generation: int, position: int, rank: int,
             world_size: int) -> float:
    """Where row `position` of `rank` in a phase falls on [0, 1): the job's rows share one
    golden-ratio sequence, indexed position * world_size + rank, so the rows of any run of
    consecutive steps (all ranks together) are one contiguous stretch of it, and the job's mix is
    as even as one rank's."""
    return (_unit(seed, phase, generation) + (position * world_size + rank) * PHI) % 1.0


def choose(weights: list[tuple[str, float]], u: float) -> str:
    """The bucket whose slice of [0, 1) holds u (weights in order, summing to 1)."""
    edge = 0.0
    for name, weight in weights:
        edge += weight
        if u < edge:
            return name
    return weights[-1][0]  # u within rounding of 1

"""
Data mixtures and curricula over pretokenized buckets (GPT-Simple's layout and rules). Every row of
a batch comes whole from one bucket, best-fit packed from that bucket's own buffer. Which bucket is
a counter-based function of (seed, phase, rank, position), so a resume continues the mix exactly. A
batch's phase is set by the tokens the whole job has trained, so all ranks switch at one step. A
bucket that runs dry stops every rank at the same step (BucketExhausted, with the last good state),
or is dropped (allow_bucket_exhaustion=True). Each bucket is put together by build.assemble.
Curricula and validation: nanochat/data/mixtures/curriculum.py; the state:
nanochat/data/mixtures/mixture_state.py. Design: docs/mixtures.md.

    python -m nanochat.mixture validate CONFIG --data DATA_DIR [--tokens N] [--split train]

May import: torch, numpy, nanochat.data.base.cli, nanochat.data.mixtures.curriculum,
nanochat.data.mixtures.mixture_state, nanochat.dataloader, nanochat.data.loader.build,
nanochat.data.pretokenized.token_reader, nanochat.data.loader.rows, nanochat.data.base.packing,
nanochat.data.base.state.
"""

import functools
import itertools
import logging
import os
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from nanochat.data.base.cli import run
# main: `python -m nanochat.mixture validate ...` runs the curriculum's command line
from nanochat.data.mixtures.curriculum import (INTERRUPTED, choose, dry_fixes, list_buckets,
                                               load_curriculum, main, row_unit, validate)
from nanochat.data.loader.build import (Assembled, DataLoader, DeviceBatches, LoaderSpec,
                                        Prepared, Run, Walk, assemble, make_loader, row_split,
                                        start_counters, sum_counters)
from nanochat.data.mixtures.mixture_state import add_mixture_checksum, mixture_start
from nanochat.dataloader import check_options, check_shuffle, resolve_rank, resolve_workers
from nanochat.data.base.packing import BestFitPacker, check_long_doc_policy
from nanochat.data.loader.rows import DocumentFeed, EntryDocuments, RowBatch, Stop, token_batches
from nanochat.data.base.state import (EMPTY_HASH, VERSION, files_fingerprint, hash_tokens,
                                      loader_config)
from nanochat.data.pretokenized.token_reader import TokenShardReader, shard_vocab

logger = logging.getLogger(__name__)


class MixtureStop(RuntimeError):
    """The mixture loader stopped on purpose; `state` is the last good state (resume from it)."""

    def __init__(self, message: str, state: dict | None):
        super().__init__(message)
        self.state = state


class BucketExhausted(MixtureStop):
    """A bucket ran dry on some rank (allow_bucket_exhaustion=False). Save a checkpoint with
    `.state` and stop; resume with allow_bucket_exhaustion=True to go on without the bucket. The
    message gives the bucket's crop share so far and the fixes for a next run."""

    def __init__(self, message: str, state: dict | None, bucket: str | None):
        super().__init__(message, state)
        self.bucket = bucket


class CurriculumComplete(MixtureStop):
    """Every phase's token budget has been trained (allow_budget_mismatch=False)."""


# -----------------------------------------------------------------------------
# The loader


class _Lookahead:
    """An iterator that can tell whether it has another item (reading one ahead, same thread)."""

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
    """One bucket: its single-pass walk, best-fit packer and state recorder."""

    def __init__(self, name: str, parts: Assembled, packer: BestFitPacker, trace: bool):
        order, recorder = parts.order, parts.recorder
        self.name, self.order, self.recorder, self.packer = name, order, recorder, packer
        self.batches = _Lookahead(token_batches(order.document_batches(), recorder.encoder))
        self.feed = DocumentFeed(self.batches, order, parts.position)
        self.trace = trace
        recorder.restore(packer)

    def _refill(self):
        return self.feed() if self.batches.more() else ()  # nothing: the bucket is drained

    def _buffered_tokens(self) -> int:
        p = self.packer
        # in, minus what left as document tokens (BOS added and repeats are not the buffer's)
        out = p.tokens_out - p.tokens_bos_added - p.tokens_repeated
        return p.tokens_in - out - p.tokens_cropped

    def fill_row(self, row: np.ndarray, buffer_size: int) -> bool:
        """Pack one row (shape (1, T+1)); False if the bucket cannot fill it any more (dry)."""
        capacity = row.shape[1]
        # read on until the buffer could finish the row: a bucket is dry only when it cannot
        while self._buffered_tokens() < capacity and self.batches.more():
            for doc, key, overlap, start in self.feed():
                self.packer.add(doc, key, overlap, start)
        if self._buffered_tokens() < capacity:
            return False
        self.packer.trace = [] if self.trace else None
        self.packer.fill(row, self._refill, buffer_size)
        return True


class BucketDoc(NamedTuple):
    """A trace entry of the mixture: a document, and the bucket it came from."""
    bucket: str
    epoch: int
    pq_idx: int
    rg_idx: int
    row: int


class BucketPiece(NamedTuple):
    """A trace entry of the mixture: a piece of a split document, from token `start` on."""
    bucket: str
    epoch: int
    pq_idx: int
    rg_idx: int
    row: int
    start: int


class _MixRules(NamedTuple):
    """What the draw of rows needs besides the phases and the buckets."""
    B: int
    T: int
    rank: int
    world_size: int
    seed: int  # picks the mix's sequence
    buffer_size: int  # per bucket
    allow_bucket_exhaustion: bool
    allow_budget_mismatch: bool


class _Mixture:
    """The curriculum's position, and the rows it draws from the buckets."""

    def __init__(self, phases, buckets: dict, rules: _MixRules, config: dict, start: dict | None):
        self.phases, self.buckets, self.config = phases, buckets, config
        self.B, self.T, self.world_size, self.rank = rules.B, rules.T, rules.world_size, rules.rank
        self.seed, self.buffer_size = rules.seed, rules.buffer_size
        self.allow_bucket_exhaustion = rules.allow_bucket_exhaustion
        self.allow_budget_mismatch = rules.allow_budget_mismatch
        # where each phase ends, in tokens of the whole job
        self.ends = list(itertools.accumulate(p.tokens for p in phases))
        s = start or {}
        self.tokens_done = s.get("tokens_done", 0)  # tokens the whole job has trained
        self.phase = s.get("phase", 1) - 1  # (the state counts phases from 1, as the messages do)
        # job tokens trained in this phase's batches
        self.phase_tokens_done = s.get("phase_tokens_done", 0)
        self.position = s.get("position", 0)  # this rank's rows drawn in the phase
        # elastic merges so far: each starts a fresh sequence of draws
        self.generation = s.get("generation", 0)
        self.dropped = set(s.get("dropped", []))
        emitted = s.get("emitted", {"batches": 0, "tokens": 0, "hash": EMPTY_HASH})
        self.batches, self.emitted_tokens = emitted["batches"], emitted["tokens"]
        self.hash = emitted["hash"]
        self.past_end_warned = False

    def _phase_of(self, tokens_done: int) -> int | None:
        for p, end in enumerate(self.ends):
            if tokens_done < end:
                return p
        return None

    def state(self) -> dict:
        return add_mixture_checksum({
            "version": VERSION, "loader": "mixture", "phase": self.phase + 1,
            "phase_tokens_done": self.phase_tokens_done, "tokens_done": self.tokens_done,
            "position": self.position, "generation": self.generation,
            "dropped": sorted(self.dropped),
            "buckets": {name: b.recorder.state(b.packer, b.feed, np.empty(0, np.uint32))
                        for name, b in self.buckets.items()},
            "config": self.config,
            "emitted": {"batches": self.batches, "tokens": self.emitted_tokens, "hash": self.hash},
        })

    def stats(self, row_buckets) -> dict:
        per = {name: b.packer.stats() for name, b in self.buckets.items()}
        total = {key: sum(s[key] for s in per.values()) for key in
                 ("tokens_tokenized", "tokens_emitted", "tokens_cropped", "tokens_masked",
                  "tokens_bos_added", "tokens_repeated", "docs_split", "buffer_docs",
                  "buffer_tokens")}
        out_docs = total["tokens_emitted"] - total["tokens_bos_added"] - total["tokens_repeated"]
        return total | {
            "crop_share": total["tokens_cropped"] / max(1, out_docs + total["tokens_cropped"]),
            "phase": self.phase + 1, "phase_tokens_done": self.phase_tokens_done,
            "tokens_done": self.tokens_done,
            "dropped": sorted(self.dropped), "row_buckets": row_buckets,
            "buckets": per,
        }

    def mixed_batches(self):
        """Yield a RowBatch per batch; its `stop` is set (with the last good state as its state)
        when the loader must stop."""
        B, T = self.B, self.T
        last_state = None
        while True:
            phase = self._phase_of(self.tokens_done)
            if phase is None:
                if not self.allow_budget_mismatch:
                    yield RowBatch(None, last_state, {}, stop=Stop("budget"))
                    return
                phase = len(self.phases) - 1
                if not self.past_end_warned:
                    self.past_end_warned = True
                    logger.warning("the curriculum's %s tokens are done; going on with the last "
                                   "phase's mix (allow_budget_mismatch=True)", f"{self.ends[-1]:,}")
            if phase != self.phase:
                if phase > self.phase + 1:
                    logger.warning("curriculum phases %s are shorter than one step (%s tokens) and "
                                   "were skipped", list(range(self.phase + 2, phase + 1)),
                                   f"{B * T * self.world_size:,}")
                self.phase, self.position, self.phase_tokens_done = phase, 0, 0
            rows = np.empty((B, T + 1), dtype=np.uint32)
            row_buckets, masked, trace = [], [], []
            for i in range(B):
                while True:
                    weights = self._weights(phase)
                    if not weights:  # every bucket of the phase ran dry on this rank
                        # (the stats: each bucket's crop share, for the message)
                        yield RowBatch(None, last_state, self.stats(row_buckets),
                                       stop=Stop("bucket"))
                        return
                    u = row_unit(self.seed, phase, self.generation, self.position, self.rank,
                                 self.world_size)
                    self.position += 1
                    name = choose(weights, u)
                    bucket = self.buckets[name]
                    if bucket.fill_row(rows[i:i + 1], self.buffer_size):
                        break
                    if not self.allow_bucket_exhaustion:
                        yield RowBatch(None, last_state, self.stats(row_buckets),
                                       stop=Stop("bucket", name))
                        return
                    self.dropped.add(name)
                    logger.warning("bucket %r ran dry on rank %d in phase %d; dropped, the other "
                                   "weights renormalised (allow_bucket_exhaustion=True)", name,
                                   self.rank, phase + 1)
                row_buckets.append(name)
                masked += [(i, start, end) for _, start, end in bucket.packer.masked]
                if bucket.trace:
                    place = bucket.order.place
                    trace += [[BucketDoc(name, *place(key)) if start is None
                               else BucketPiece(name, *place(key), start)
                               for key, start in row] for row in bucket.packer.trace]
            self.tokens_done += B * T * self.world_size
            self.phase_tokens_done += B * T * self.world_size
            self.batches += 1
            self.emitted_tokens += rows.size
            self.hash = hash_tokens(self.hash, rows)
            last_state = self.state()
            yield RowBatch(rows, last_state, self.stats(row_buckets), trace if trace else None,
                           masked)

    def _weights(self, phase: int) -> list[tuple[str, float]]:
        """The phase's weights without the dropped buckets, renormalised (empty: all dropped)."""
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
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size() != world_size:  # a loader for a subset of the job (rank 0's eval)
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    if not _FLAG_GROUP:
        _FLAG_GROUP.append(dist.new_group(backend="gloo"))
    return _FLAG_GROUP[0]


def _agree(code: int, group) -> int:
    """The largest stop code over all ranks: one 4-byte all_reduce on the CPU group."""
    if group is None:
        return code
    flag = torch.tensor([code], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item())


class MixtureLoader(DataLoader):
    """The DataLoader of pretokenized_mixture_loader...: stops, on every rank at the same step, with
    BucketExhausted or CurriculumComplete. `stats` adds the phase, tokens done, dropped buckets,
    per-bucket statistics, and `row_buckets` (each row's bucket in the last batch)."""

    STOP_CODES = {None: 0, "budget": 1, "bucket": 2}
    FAILED = 3  # this rank's loader failed (a bad shard, ...): the others stop too, not wait

    def __init__(self, *args, start_state=None, world_size=1, fixes="", **kwargs):
        super().__init__(*args, **kwargs)
        self.last_state = start_state
        self._fixes = fixes  # what BucketExhausted's message suggests (curriculum.dry_fixes)
        # Looked up at each step, never kept: a loader held until the interpreter's exit (in a
        # reference cycle, or never closed) would keep a gloo group alive after
        # destroy_process_group(), and its worker thread then frees the flag tensors while Python
        # is shutting down, which aborts the process.
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

    def worker_info(self) -> dict:
        return super().worker_info() | {"extras": {"start_state": self.last_state,
                                                   "world_size": self._world_size,
                                                   "fixes": self._fixes}}

    def _packer_counters(self, batch: RowBatch) -> dict:
        return sum_counters(state["counters"] for state in batch.state["buckets"].values())

    def _check(self, batch: RowBatch) -> None:
        stop = batch.stop
        code = _agree(self.STOP_CODES[stop.kind if stop else None], _flag_group(self._world_size))
        if not code:
            self.last_state = batch.state
        if code == self.FAILED:
            self._told_failure = True
            raise RuntimeError("the mixture loader failed on another rank (see its error); "
                               "stopping here too")
        if code == 2:
            raise BucketExhausted(self._dry_message(batch), self.last_state,
                                  stop.bucket if stop else None)
        if code == 1:
            raise CurriculumComplete("every phase of the curriculum is done; its `state` is the "
                                     "last good state (pass allow_budget_mismatch=True to go on "
                                     "with the last phase)", self.last_state)

    def _dry_message(self, batch: RowBatch) -> str:
        """BucketExhausted's message: which bucket, its crop share so far, what to do."""
        stop, crops = batch.stop, {name: s["crop_share"]
                                   for name, s in batch.stats.get("buckets", {}).items()}
        if stop and stop.bucket:
            dry = (f"bucket {stop.bucket!r} ran dry on this rank (its crop share so far: "
                     f"{crops[stop.bucket]:.2f})")
        elif stop:
            shares = ", ".join(f"{name} {crop:.2f}" for name, crop in sorted(crops.items()))
            dry = ("every bucket of the current phase ran dry on this rank (crop shares so "
                     f"far: {shares})")
        else:
            dry = "a bucket ran dry on another rank (its message says which)"
        return (f"{dry}; its `state` is the last good state: save a checkpoint with it and stop, "
                "or resume with allow_bucket_exhaustion=True to drop the bucket. For a run that "
                f"does not run dry, the fixes: {self._fixes}")


def pretokenized_mixture_loader_with_state_bos_bestfit(
        B: int, T: int, split: str, curriculum, device="cuda",
        resume_state_dict: dict | None = None, buffer_size: int = 1000, *, data_dir: str,
        seed: int = 0, bos_token: int | None = None, chunk_size: int = 1024,
        batch_size: int = 128, rank: int | None = None, world_size: int | None = None,
        prefetch: int = 4, with_state: bool = True, allow_state_mismatch: bool = False,
        allow_bucket_exhaustion: bool = False, allow_budget_mismatch: bool = False,
        total_tokens: int | None = None, trace_documents: bool = False,
        long_doc_policy: str = "crop", split_overlap: int = 0, vocab_size: int | None = None,
        shuffle: bool = False, shuffle_window: int = 8,
        workers: int | None = None) -> MixtureLoader:
    """Yield (inputs, targets, state_dict): best-fit rows, each from one bucket of
    data_dir/split/<bucket>/, mixed by the curriculum. buffer_size is per bucket. seed picks the
    mix's sequence. total_tokens: tokens the run will train (all ranks), checked against the
    curriculum. vocab_size, bos_token: as for the pretokenized loader; pretokenize.json is looked
    for in data_dir and in each bucket's directory (all that record a BOS must agree). shuffle,
    shuffle_window: each bucket's chunks and entries in a seeded order (seed and the bucket's name).
    Raises BucketExhausted / CurriculumComplete (with .state, the last good state) where it must
    stop. A fresh loader checks the curriculum against the buckets first, their crop under T and
    long_doc_policy estimated: a ValueError for a shortfall of tokens, a logged warning (at the
    call) for a bucket that cropping will run dry. workers: as for the parquet loader (the stop is
    agreed here, in the trainer's process). Details: docs/mixtures.md."""
    args = dict(locals())
    workers = resolve_workers(workers, prefetch)
    if workers:  # (B, T: the size of the worker's shared memory)
        check_options(B, T, split, prefetch)
    return make_loader(MixtureLoader, Run(B, T, split, device, prefetch, with_state, workers),
                       lambda: _prepare(args))


def _prepare(args: dict) -> Prepared:
    """The mixture loader's arguments checked, its state too, and the curriculum against the
    buckets when it starts afresh; then each bucket's spec."""
    B, T, split, seed = args["B"], args["T"], args["split"], args["seed"]
    buffer_size, batch_size = args["buffer_size"], args["batch_size"]
    chunk_size = args["chunk_size"]
    long_doc_policy, split_overlap = args["long_doc_policy"], args["split_overlap"]
    allow_bucket_exhaustion = args["allow_bucket_exhaustion"]
    allow_budget_mismatch = args["allow_budget_mismatch"]
    allow_state_mismatch, total_tokens = args["allow_state_mismatch"], args["total_tokens"]
    check_options(B, T, split, args["prefetch"], buffer_size=buffer_size, chunk_size=chunk_size,
                  batch_size=batch_size)
    check_long_doc_policy(long_doc_policy, split_overlap, T)
    order = check_shuffle(args["shuffle"], seed, args["shuffle_window"])
    rank, world_size = resolve_rank(args["rank"], args["world_size"])
    data_dir = os.path.expanduser(os.fspath(args["data_dir"]))
    paths = list_buckets(data_dir, split)
    phases = load_curriculum(args["curriculum"], paths)
    # the vocabulary and the BOS: the arguments, or pretokenize.json in data_dir or in a bucket's
    # directory (all must agree)
    vocab = shard_vocab(next(iter(paths.values()))[0], args["bos_token"], args["vocab_size"],
                        [data_dir] + [os.path.join(data_dir, split, name) for name in paths])
    bos_token = vocab.bos_token
    used = sorted({name for p in phases for name in p.mix})
    step_tokens = B * T * world_size  # tokens the whole job trains per step
    config = {"loader": "mixture", "source": "pretokenized", "split": split,
              "buckets": {name: files_fingerprint(paths[name]) for name in used},
              "chunk_size": chunk_size, "B": B, "T": T, "buffer_size": buffer_size,
              "tokenizer_batch_size": batch_size, "tokenizer": f"bos:{bos_token}", "seed": seed,
              "curriculum": [[p.tokens, [[name, w] for name, w in sorted(p.mix.items())]]
                             for p in phases],
              "rank": rank, "world_size": world_size, "long_doc_policy": long_doc_policy,
              "split_overlap": split_overlap}
    if args["shuffle"]:  # (an unshuffled mixture's config has no "shuffle" key at all)
        config["shuffle"] = {"window": args["shuffle_window"]}
    state, state_name = mixture_start(args["resume_state_dict"], config, rank, world_size,
                                      allow_state_mismatch)
    planned = sum(p.tokens for p in phases)
    if state is None:  # a fresh run: refuse a curriculum that is predicted to run dry
        _, problems, notes = validate(
            phases, data_dir, split, total_tokens=total_tokens,
            allow_bucket_exhaustion=allow_bucket_exhaustion,
            allow_budget_mismatch=allow_budget_mismatch, T=T, world_size=world_size,
            chunk_size=chunk_size, step_tokens=step_tokens, shuffle=order,
            long_doc_policy=long_doc_policy)
        for note in notes:
            logger.warning("mixture: %s", note)
        if problems:
            raise ValueError("the curriculum does not fit the data: " + "; ".join(problems) +
                             " (python -m nanochat.mixture validate prints the whole table; "
                             "allow_bucket_exhaustion / allow_budget_mismatch accept it)")
    elif (total_tokens is not None and abs(total_tokens - planned) >= step_tokens
          and not allow_budget_mismatch):
        raise ValueError(f"budget mismatch: the curriculum totals {planned:,} tokens, the run will "
                         f"train {total_tokens:,}; pass allow_budget_mismatch=True to accept it")
    encoder = EntryDocuments(bos_token, always=vocab.convention == "gpt-simple")
    walks = []
    for name in used:
        bucket_order = order and order.bucket(name)
        sub_config = loader_config("bestfit", "pretokenized", f"{split}/{name}", paths[name],
                                   B=B, T=T, buffer_size=buffer_size, batch_size=batch_size,
                                   tokenizer=config["tokenizer"], rank=rank, world_size=world_size,
                                   chunk_size=chunk_size, policy=(long_doc_policy, split_overlap),
                                   shuffle=bucket_order)
        spec = LoaderSpec(kind="bestfit", reader=TokenShardReader(paths[name], chunk_size, vocab),
                          encoder=encoder, config=sub_config, rank=rank, world_size=world_size,
                          batch_size=batch_size, B=B, T=T, buffer_size=buffer_size,
                          shuffle=bucket_order, allow_state_mismatch=allow_state_mismatch,
                          epochs=1, state_name=f"{state_name}['buckets'][{name!r}]")
        walks.append(Walk(spec, state["buckets"][name] if state else None))
    rules = _MixRules(B, T, rank, world_size, seed, buffer_size, allow_bucket_exhaustion,
                      allow_budget_mismatch)
    mix = _MixtureSpec(dict(zip(used, walks)), phases, rules, config, state,
                       (long_doc_policy, split_overlap), args["trace_documents"],
                       args["prefetch"], args["with_state"])
    return Prepared(walks, functools.partial(_build_mixture, mix))


class _MixtureSpec(NamedTuple):
    """What the mixture loader is built from, here or (pickled) in a worker process."""
    walks: dict  # bucket -> its Walk
    phases: list
    rules: _MixRules
    config: dict
    state: dict | None  # the mixture's resume state; None: fresh
    policy: tuple[str, int]  # (long_doc_policy, split_overlap)
    trace_documents: bool
    prefetch: int
    with_state: bool


def _build_mixture(mix: _MixtureSpec, device) -> MixtureLoader:
    B, T = mix.rules.B, mix.rules.T
    buckets = {name: (assemble(spec, bucket_state), BestFitPacker(T + 1, *mix.policy))
               for name, (spec, bucket_state) in mix.walks.items()}

    def batches():
        made = {name: _Bucket(name, parts, packer, mix.trace_documents)
                for name, (parts, packer) in buckets.items()}
        yield from _Mixture(mix.phases, made, mix.rules, mix.config, mix.state).mixed_batches()

    return MixtureLoader(batches(), DeviceBatches(B, T, device), row_split, mix.prefetch,
                         mix.with_state, start_state=mix.state, world_size=mix.rules.world_size,
                         fixes=dry_fixes(T, mix.policy[0]),
                         start_counters=start_counters("bestfit", [
                             parts.recorder for parts, _ in buckets.values()]))


def pretokenized_mixture_loader_bos_bestfit(*args, **kwargs):
    """Like pretokenized_mixture_loader_with_state_bos_bestfit, yielding (inputs, targets)."""
    return pretokenized_mixture_loader_with_state_bos_bestfit(*args, with_state=False, **kwargs)


if __name__ == "__main__":
    run(main, INTERRUPTED)

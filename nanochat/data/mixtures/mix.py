"""
The curriculum's draw of rows, each from one bucket.
The curriculum's draw of rows: which bucket fills each row (a counter-based function of seed,
phase, rank and position, so a resume continues the mix exactly), packed from that bucket's own
buffer; the phase set by the tokens the whole job has trained, so all ranks switch at one step; a
bucket that runs dry stops the batch, or is dropped (allow_bucket_exhaustion=True). Yields
RowBatch records with the mixture state. Design: docs/mixtures.md.

May import: numpy, nanochat.data.base, nanochat.data.loader.rows, nanochat.data.mixtures.curriculum,
nanochat.data.mixtures.mixture_state.
"""

import itertools
import logging
from typing import NamedTuple

import numpy as np

from nanochat.data.base.packing import BestFitPacker
from nanochat.data.base.state import EMPTY_HASH, VERSION, hash_tokens
from nanochat.data.loader.rows import DocumentFeed, RowBatch, Stop, restore_buffer, token_batches
from nanochat.data.mixtures.curriculum import Phase, choose, row_unit
from nanochat.data.mixtures.mixture_state import add_mixture_checksum

logger = logging.getLogger(__name__)


class MixRules(NamedTuple):
    """What the draw of rows needs besides the phases and the buckets."""
    B: int
    T: int
    rank: int
    world_size: int
    seed: int  # picks the mix's sequence
    buffer_size: int  # per bucket
    allow_bucket_exhaustion: bool
    allow_budget_mismatch: bool


def mixture_batches(phases: list[Phase], buckets: dict, rules: MixRules, config: dict,
                    resumed: dict | None, trace: bool = False):
    """Yield a RowBatch per batch; its `stop` is set (with the last good state as its state) when
    the loader must stop. buckets: {name: (its walk, build.assemble's parts; its packer)},
    resumed: the state resumed from (None: afresh), trace: record each row's documents."""
    made = {name: _Bucket(name, parts, packer, trace) for name, (parts, packer) in buckets.items()}
    yield from _Mixture(phases, made, rules, config, resumed).mixed_batches()


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

    def __init__(self, name: str, parts, packer: BestFitPacker, trace: bool):
        # parts: the bucket's walk as build.assemble makes it (order, recorder, position)
        order, recorder = parts.order, parts.recorder
        self.name, self.order, self.recorder, self.packer = name, order, recorder, packer
        self.batches = _Lookahead(token_batches(order.document_batches(), recorder.encoder))
        self.feed = DocumentFeed(self.batches, order, parts.position)
        self.trace = trace
        restore_buffer(recorder, packer)

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
    doc_index: int


class BucketPiece(NamedTuple):
    """A trace entry of the mixture: a piece of a split document, from token `start` on."""
    bucket: str
    epoch: int
    pq_idx: int
    rg_idx: int
    doc_index: int
    start: int


class _Mixture:
    """The curriculum's position, and the rows it draws from the buckets."""

    def __init__(self, phases, buckets: dict, rules: MixRules, config: dict, resumed: dict | None):
        self.phases, self.buckets, self.config = phases, buckets, config
        self.B, self.T, self.world_size, self.rank = rules.B, rules.T, rules.world_size, rules.rank
        self.seed, self.buffer_size = rules.seed, rules.buffer_size
        self.allow_bucket_exhaustion = rules.allow_bucket_exhaustion
        self.allow_budget_mismatch = rules.allow_budget_mismatch
        # where each phase ends, in tokens of the whole job
        self.ends = list(itertools.accumulate(p.tokens for p in phases))
        s = resumed or {}
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
            "buckets": {name: b.recorder.state(b.packer, b.feed.progress(), np.empty(0, np.uint32))
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
        """Yield a RowBatch per batch (mixture_batches)."""
        B, T = self.B, self.T
        last_state = None
        while True:
            phase = self._enter_phase()
            if phase is None:  # every phase's budget is trained (allow_budget_mismatch=False)
                yield RowBatch(None, last_state, {}, stop=Stop("budget"))
                return
            rows = np.empty((B, T + 1), dtype=np.uint32)
            row_buckets, masked, trace = [], [], []
            for i in range(B):
                name, stop = self._fill(rows[i:i + 1], phase)
                if stop is not None:
                    # (the stats: each bucket's crop share, for the message)
                    yield RowBatch(None, last_state, self.stats(row_buckets), stop=stop)
                    return
                bucket = self.buckets[name]
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

    def _enter_phase(self) -> int | None:
        """The phase of the next batch (0-based), entered if it is a new one; None when the
        curriculum is done and the loader must stop."""
        phase = self._phase_of(self.tokens_done)
        if phase is None:
            if not self.allow_budget_mismatch:
                return None
            phase = len(self.phases) - 1
            if not self.past_end_warned:
                self.past_end_warned = True
                logger.warning("the curriculum's %s tokens are done; going on with the last "
                               "phase's mix (allow_budget_mismatch=True)", f"{self.ends[-1]:,}")
        if phase != self.phase:
            if phase > self.phase + 1:
                logger.warning("curriculum phases %s are shorter than one step (%s tokens) and "
                               "were skipped", list(range(self.phase + 2, phase + 1)),
                               f"{self.B * self.T * self.world_size:,}")
            self.phase, self.position, self.phase_tokens_done = phase, 0, 0
        return phase

    def _fill(self, row: np.ndarray, phase: int) -> tuple[str | None, Stop | None]:
        """Fill one row from the bucket the draw picks: (its name, None), or (None, the Stop) when
        the phase's buckets ran dry on this rank and the loader must stop."""
        while True:
            weights = self._weights(phase)
            if not weights:  # every bucket of the phase ran dry on this rank
                return None, Stop("bucket")
            u = row_unit(self.seed, phase, self.generation, self.position, self.rank,
                         self.world_size)
            self.position += 1
            name = choose(weights, u)
            if self.buckets[name].fill_row(row, self.buffer_size):
                return name, None
            if not self.allow_bucket_exhaustion:
                return None, Stop("bucket", name)
            self.dropped.add(name)
            logger.warning("bucket %r ran dry on rank %d in phase %d; dropped, the other "
                           "weights renormalised (allow_bucket_exhaustion=True)", name,
                           self.rank, phase + 1)

    def _weights(self, phase: int) -> list[tuple[str, float]]:
        """The phase's weights without the dropped buckets, renormalised (empty: all dropped)."""
        mix = {name: w for name, w in self.phases[phase].mix.items() if name not in self.dropped}
        total = sum(mix.values())
        return [(name, w / total) for name, w in sorted(mix.items())]

"""
The pure packing core: tokenized documents in, full rows out. No files, no torch, no threads.

Two packers share one contract (`add` documents, then fill rows, pulling more documents through a
`refill` callable whenever the buffer runs low), so the parquet loader, the pretokenized loader and
the benchmark all drive the same code:

- `BestFitPacker`: nanochat's BOS-aligned best-fit. Every row starts with BOS (every document does)
  and has no padding; the price is cropping (about a third of tokens at T=2048 on FineWeb-like text,
  measured in scripts/bench_dataloader.py).
- `ConcatPacker`: the older loader's token stream: documents back to back, no alignment, no waste.

Documents are numpy arrays of the narrowest unsigned dtype the vocabulary allows (2 bytes per token
for vocabularies up to 65,536), so the buffer costs 2-4 bytes per buffered token plus ~150 bytes per
document.
"""

import heapq
from collections import deque
from typing import Callable, Iterable

import numpy as np

# refill() returns the next (document, key, overlap) of the stream (possibly none): keys name documents
# for resume states and traces (or are None); overlap counts the tokens after BOS that repeat the
# previous window of a windowed document (0 for whole documents)
Refill = Callable[[], Iterable[tuple[np.ndarray, object, int]]]


def token_dtype(vocab_size: int | None) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a vocabulary (uint32 when unknown)."""
    if vocab_size is not None and vocab_size <= 2**16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


# -----------------------------------------------------------------------------
# Best-fit


class BestFitPacker:
    """A buffer of documents indexed by length, and the best-fit rule that empties it into rows.

    Placement rule, per row of `row_capacity` tokens (T+1):
      - the largest buffered document with length <= remaining space is placed whole;
      - if none fits, the shortest buffered document is cropped to fill the row exactly and its
        rest is discarded;
      - ties on length go to the document that entered the buffer first.

    Cost per placement: documents that fit a row sit in per-length FIFO queues, and a bitmask
    (a Python int, bit L set <=> some document of length L is buffered) answers "largest length
    <= remaining" with one mask and `bit_length()`, and "shortest" with the lowest set bit. Those
    are C operations on T/64 machine words (32 words at T=2048): constant next to the interpreter's
    own cost, independent of the buffer size. Documents longer than a row can only ever be
    cropped, so they wait in a heap keyed by (length, arrival).
    """

    # the running totals a resume state carries, so statistics continue across a restart
    COUNTERS = ("tokens_in", "tokens_out", "tokens_cropped", "rows", "docs_placed", "max_docs_per_row",
                "tokens_masked")

    def __init__(self, row_capacity: int):
        if row_capacity < 2:
            raise ValueError(f"row_capacity must be >= 2 (T >= 1), got {row_capacity}")
        self.row_capacity = row_capacity
        self._by_length: dict[int, deque] = {}  # length -> deque of (seq, doc), oldest first
        self._fit_mask = 0  # bit L set <=> self._by_length[L] is non-empty
        self._long: list = []  # heap of (length, seq, doc) for documents longer than a row
        self._seq = 0  # arrival counter: the tie-break
        self._num_docs = 0
        # seq -> key of each buffered document, in arrival order (what a resume state refers to)
        self._keys: dict[int, object] = {}
        self._overlaps: dict[int, int] = {}  # seq -> leading tokens (after BOS) that repeat a window
        # what the last fill() placed, per row: document start positions, and target ranges to mask
        self.trace: list | None = None  # set to a list to record, per row, the keys placed in it
        self.starts: list[list[int]] = []
        self.masked: list[tuple[int, int, int]] = []  # (row, start, end): targets[row, start:end] = -100
        # running totals, cheap to read at any step
        self.tokens_in = 0
        self.tokens_out = 0
        self.tokens_cropped = 0
        self.rows = 0
        self.docs_placed = 0  # documents (whole or cropped) that went into rows
        self.max_docs_per_row = 0
        self.tokens_masked = 0

    def __len__(self) -> int:
        return self._num_docs

    def stats(self) -> dict:
        """Running totals: what entered the buffer, what went out in rows, what was cropped away."""
        return {
            "tokens_tokenized": self.tokens_in,
            "tokens_emitted": self.tokens_out,
            "tokens_cropped": self.tokens_cropped,
            "crop_share": self.tokens_cropped / max(1, self.tokens_out + self.tokens_cropped),
            "docs_per_row_mean": self.docs_placed / max(1, self.rows),
            "docs_per_row_max": self.max_docs_per_row,
            "buffer_docs": self._num_docs,
            "buffer_tokens": self.tokens_in - self.tokens_out - self.tokens_cropped,
            "tokens_masked": self.tokens_masked,
        }

    def buffered_keys(self) -> list:
        """Keys of the buffered documents in arrival order (insertion order of the dict)."""
        return list(self._keys.values())

    def add(self, doc: np.ndarray, key=None, overlap: int = 0) -> None:
        """Buffer a document; `key` names it (e.g. where it was read) in buffered_keys() and traces;
        `overlap`: how many tokens after its BOS repeat the previous window of the same document
        (their targets are masked when it is placed)."""
        n = len(doc)
        if n == 0:
            raise ValueError("cannot pack an empty document (every document starts with BOS)")
        if n <= self.row_capacity:
            bucket = self._by_length.get(n)
            if bucket is None:
                bucket = self._by_length[n] = deque()
                self._fit_mask |= 1 << n
            bucket.append((self._seq, doc))
        else:
            heapq.heappush(self._long, (n, self._seq, doc))
        self._keys[self._seq] = key
        if overlap:
            self._overlaps[self._seq] = overlap
        self._seq += 1
        self._num_docs += 1
        self.tokens_in += n

    def _pop_length(self, n: int) -> tuple[int, np.ndarray]:
        bucket = self._by_length[n]
        seq, doc = bucket.popleft()
        if not bucket:
            del self._by_length[n]
            self._fit_mask &= ~(1 << n)
        return seq, doc

    def _taken(self, seq: int) -> tuple[object, int]:
        self._num_docs -= 1
        return self._keys.pop(seq), self._overlaps.pop(seq, 0)

    def place(self, row: np.ndarray, pos: int) -> int:
        """Place one document into row[pos:] by the best-fit rule; returns the new position."""
        return self._place(row, pos)[0]

    def _place(self, row: np.ndarray, pos: int) -> tuple[int, object, int]:
        """place(), also returning the placed document's key and overlap."""
        remaining = self.row_capacity - pos
        fits = self._fit_mask & ((2 << remaining) - 1)  # lengths 1..remaining
        if fits:
            n = fits.bit_length() - 1  # the largest that fits
            seq, doc = self._pop_length(n)
            row[pos:pos + n] = doc
            self.tokens_out += n
            return pos + n, *self._taken(seq)
        # nothing fits: crop the shortest; every short document is shorter than every long one
        if self._fit_mask:
            n = (self._fit_mask & -self._fit_mask).bit_length() - 1
            seq, doc = self._pop_length(n)
        elif self._long:
            n, seq, doc = heapq.heappop(self._long)
        else:
            raise RuntimeError("BestFitPacker.place called with an empty buffer")
        row[pos:] = doc[:remaining]
        self.tokens_out += remaining
        self.tokens_cropped += n - remaining
        return self.row_capacity, *self._taken(seq)

    def fill(self, rows: np.ndarray, refill: Refill, buffer_size: int) -> None:
        """Fill every row of `rows` (shape (n, row_capacity)), refilling the buffer to at least
        `buffer_size` documents before each placement, as the seeds' loader does."""
        assert rows.shape[1] == self.row_capacity
        self.starts, self.masked = [], []
        for r, row in enumerate(rows):
            pos, starts = 0, []
            if self.trace is not None:
                self.trace.append([])
            while pos < self.row_capacity:
                while self._num_docs < buffer_size:
                    for doc, key, overlap in refill():
                        self.add(doc, key, overlap)
                start = pos
                pos, key, overlap = self._place(row, pos)
                starts.append(start)
                if self.trace is not None:
                    self.trace[-1].append(key)
                if overlap:
                    # the targets that predict the repeated tokens (row positions start+1..start+overlap,
                    # so targets start..start+overlap-1), as far as the document made it into the row
                    end = min(start + overlap, pos - 1)
                    if end > start:
                        self.masked.append((r, start, end))
                        self.tokens_masked += end - start
            self.starts.append(starts)
            self.rows += 1
            self.docs_placed += len(starts)
            self.max_docs_per_row = max(self.max_docs_per_row, len(starts))


# -----------------------------------------------------------------------------
# Concatenation


class ConcatPacker:
    COUNTERS = ("tokens_in", "tokens_out")

    """Documents back to back as one token stream; `take` cuts the next n tokens off its front."""

    def __init__(self):
        self._docs: deque = deque()  # (document, key) not yet fully consumed
        self._offset = 0  # tokens of the first document already consumed
        self._num_tokens = 0  # tokens buffered and not yet consumed
        self.tokens_in = 0
        self.tokens_out = 0

    def __len__(self) -> int:
        return self._num_tokens

    def stats(self) -> dict:
        return {"tokens_tokenized": self.tokens_in, "tokens_emitted": self.tokens_out,
                "tokens_cropped": 0, "crop_share": 0.0, "buffer_tokens": self._num_tokens}

    def buffered_keys(self) -> list:
        """Keys of the documents not yet fully consumed, in order; `offset` tokens of the first are."""
        return [key for _, key in self._docs]

    @property
    def offset(self) -> int:
        return self._offset

    def add(self, doc: np.ndarray, key=None, overlap: int = 0) -> None:
        """Append a document to the stream (a window's overlap is streamed as it is: the
        concatenating loader does not mask)."""
        if len(doc):
            self._docs.append((doc, key))
            self._num_tokens += len(doc)
            self.tokens_in += len(doc)

    def skip_consumed(self, offset: int) -> None:
        """Mark the first `offset` tokens of the first buffered document as already consumed (a
        resume rebuilds the buffer from whole documents)."""
        assert self._offset == 0 and (not self._docs or offset < len(self._docs[0][0]))
        self._offset = offset
        self._num_tokens -= offset

    def take(self, out: np.ndarray, refill: Refill) -> None:
        """Fill the 1-D array `out` with the next len(out) tokens of the stream."""
        needed = len(out)
        while self._num_tokens < needed:
            for doc, key, overlap in refill():
                self.add(doc, key, overlap)
        pos = 0
        while pos < needed:
            doc = self._docs[0][0]
            n = min(len(doc) - self._offset, needed - pos)
            out[pos:pos + n] = doc[self._offset:self._offset + n]
            pos += n
            self._offset += n
            if self._offset == len(doc):
                self._docs.popleft()
                self._offset = 0
        self._num_tokens -= needed
        self.tokens_out += needed

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

# refill() returns the next documents of the stream (possibly an empty list)
Refill = Callable[[], Iterable[np.ndarray]]


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

    def __init__(self, row_capacity: int):
        if row_capacity < 2:
            raise ValueError(f"row_capacity must be >= 2 (T >= 1), got {row_capacity}")
        self.row_capacity = row_capacity
        self._by_length: dict[int, deque] = {}  # length -> deque of (seq, doc), oldest first
        self._fit_mask = 0  # bit L set <=> self._by_length[L] is non-empty
        self._long: list = []  # heap of (length, seq, doc) for documents longer than a row
        self._seq = 0  # arrival counter: the tie-break
        self._num_docs = 0
        # running totals, cheap to read at any step
        self.tokens_in = 0
        self.tokens_out = 0
        self.tokens_cropped = 0
        self.rows = 0
        self.docs_placed = 0  # documents (whole or cropped) that went into rows
        self.max_docs_per_row = 0

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
        }

    def add(self, doc: np.ndarray) -> None:
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
        self._seq += 1
        self._num_docs += 1
        self.tokens_in += n

    def _pop_length(self, n: int) -> np.ndarray:
        bucket = self._by_length[n]
        _, doc = bucket.popleft()
        if not bucket:
            del self._by_length[n]
            self._fit_mask &= ~(1 << n)
        return doc

    def place(self, row: np.ndarray, pos: int) -> int:
        """Place one document into row[pos:] by the best-fit rule; returns the new position."""
        remaining = self.row_capacity - pos
        fits = self._fit_mask & ((2 << remaining) - 1)  # lengths 1..remaining
        if fits:
            n = fits.bit_length() - 1  # the largest that fits
            row[pos:pos + n] = self._pop_length(n)
            self._num_docs -= 1
            self.tokens_out += n
            return pos + n
        # nothing fits: crop the shortest; every short document is shorter than every long one
        if self._fit_mask:
            n = (self._fit_mask & -self._fit_mask).bit_length() - 1
            doc = self._pop_length(n)
        elif self._long:
            n, _, doc = heapq.heappop(self._long)
        else:
            raise RuntimeError("BestFitPacker.place called with an empty buffer")
        row[pos:] = doc[:remaining]
        self._num_docs -= 1
        self.tokens_out += remaining
        self.tokens_cropped += n - remaining
        return self.row_capacity

    def fill(self, rows: np.ndarray, refill: Refill, buffer_size: int) -> None:
        """Fill every row of `rows` (shape (n, row_capacity)), refilling the buffer to at least
        `buffer_size` documents before each placement, as the seeds' loader does."""
        assert rows.shape[1] == self.row_capacity
        for row in rows:
            pos, placed = 0, 0
            while pos < self.row_capacity:
                while self._num_docs < buffer_size:
                    for doc in refill():
                        self.add(doc)
                pos = self.place(row, pos)
                placed += 1
            self.rows += 1
            self.docs_placed += placed
            self.max_docs_per_row = max(self.max_docs_per_row, placed)


# -----------------------------------------------------------------------------
# Concatenation


class ConcatPacker:
    """Documents back to back as one token stream; `take` cuts the next n tokens off its front."""

    def __init__(self):
        self._docs: deque = deque()  # documents not yet fully consumed
        self._offset = 0  # tokens of self._docs[0] already consumed
        self._num_tokens = 0  # tokens buffered and not yet consumed
        self.tokens_in = 0
        self.tokens_out = 0

    def __len__(self) -> int:
        return self._num_tokens

    def stats(self) -> dict:
        return {"tokens_tokenized": self.tokens_in, "tokens_emitted": self.tokens_out,
                "tokens_cropped": 0, "crop_share": 0.0, "buffer_tokens": self._num_tokens}

    def add(self, doc: np.ndarray) -> None:
        if len(doc):
            self._docs.append(doc)
            self._num_tokens += len(doc)
            self.tokens_in += len(doc)

    def take(self, out: np.ndarray, refill: Refill) -> None:
        """Fill the 1-D array `out` with the next len(out) tokens of the stream."""
        needed = len(out)
        while self._num_tokens < needed:
            for doc in refill():
                self.add(doc)
        pos = 0
        while pos < needed:
            doc = self._docs[0]
            n = min(len(doc) - self._offset, needed - pos)
            out[pos:pos + n] = doc[self._offset:self._offset + n]
            pos += n
            self._offset += n
            if self._offset == len(doc):
                self._docs.popleft()
                self._offset = 0
        self._num_tokens -= needed
        self.tokens_out += needed

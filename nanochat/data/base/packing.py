"""
The pure packing core: tokenized documents in, full rows out. No files, no torch, no threads.
Two packers share one contract (`add` documents, then fill rows, pulling more through a `refill`
callable whenever the buffer runs low), so the parquet loader, the pretokenized loader and the
benchmark all drive the same code:
- BestFitPacker: nanochat's BOS-aligned best-fit. Its long_doc_policy "split" and "split_reuse"
  cut long documents into BOS-led pieces instead of cropping them (docs/long-documents.md).
- ConcatPacker: nanochat's concatenating loader: documents back to back, no
  alignment, no waste.

Cost: documents are numpy arrays of the narrowest unsigned dtype the vocabulary allows, so the
buffer costs 2-4 bytes per token plus ~150 bytes per document. A placement costs the same at any
buffer size.

May import: numpy and nanochat.data.base.checks (no I/O, no torch, no threads).
"""

import heapq
from collections import deque
from typing import Callable, Iterable, NamedTuple

import numpy as np

from nanochat.data.base.checks import check_int


class Piece(NamedTuple):
    """What a refill hands the packer: a document, or one piece of it."""
    doc: np.ndarray  # token ids, BOS first
    key: object  # names the document in states and traces (or None)
    overlap: int  # tokens after BOS that repeat the window before (0 for a whole document)
    start: int | None  # None: the whole document; else the one piece from this token on


Refill = Callable[[], Iterable[Piece]]  # the next Pieces of the walk (possibly none)


# -----------------------------------------------------------------------------
# Best-fit


class BestFitPacker:
    """A buffer of documents indexed by length, and the best-fit rule that empties it into rows.

    Placement rule, per row of `row_capacity` tokens (T+1):
      - the largest buffered document with length <= remaining space is placed whole;
      - if none fits, the shortest buffered document is cropped to fill the row exactly;
      - ties on length go to the document that entered the buffer first.
    What happens to the cropped rest is the long_doc_policy (docs/long-documents.md): "crop"
    (nanochat's rule) and "split" discard it, "split_reuse" puts it back as a piece. "split" and
    "split_reuse" also cut a document longer than a row into pieces on the next_cut() grid when it
    is added.
    A piece is (document, start): BOS, the `overlap` tokens before `start` (their targets masked),
    then the document from `start`; the buffer refers to it by (key, start).
    """

    # the running totals a resume state carries, so statistics continue across a restart
    COUNTERS = ("tokens_in", "tokens_out", "tokens_cropped", "rows", "docs_placed",
                "max_docs_per_row", "tokens_masked", "tokens_bos_added", "tokens_repeated",
                "tokens_continued", "docs_split")

    def __init__(self, row_capacity: int, long_doc_policy: str = "crop", overlap: int = 0):
        check_int("row_capacity", row_capacity, 2, hint=" (T >= 1)")
        check_long_doc_policy(long_doc_policy, overlap, row_capacity - 1)
        self.row_capacity = row_capacity
        self.policy, self.overlap = long_doc_policy, overlap
        # Documents that fit a row sit in per-length FIFO queues; _fit_mask (a Python int) has bit
        # L set when some document of length L is buffered. "Largest length <= remaining" is then
        # one mask and bit_length(), "shortest" the lowest set bit: C operations on T/64 machine
        # words (32 at T=2048), so a placement costs the same at any buffer size.
        self._by_length: dict[int, deque] = {}  # length -> deque of (seq, doc), oldest first
        self._fit_mask = 0  # bit L set <=> self._by_length[L] is non-empty
        # documents longer than a row (only under "crop") can only ever be cropped: a heap of
        # (length, seq, doc) hands out the shortest, oldest first
        self._long: list = []
        self._seq = 0  # arrival counter: the tie-break
        self._num_docs = 0
        # seq -> key of each buffered document, in arrival order (what a resume state refers to)
        self._keys: dict[int, object] = {}
        self._overlaps: dict[int, int] = {}  # seq -> tokens after BOS that repeat a window
        self._starts: dict[int, int] = {}  # seq -> start of a piece (absent: a whole document)
        # what the last fill() placed, per row: document start positions, and target ranges to mask
        self.trace: list | None = None  # set to a list to record, per row, the (key, start) placed
        self.starts: list[list[int]] = []
        # (row, start, end): targets[row, start:end] = -100
        self.masked: list[tuple[int, int, int]] = []
        # running totals, cheap to read at any step
        self.tokens_in = 0  # document tokens that entered (each once, however it is cut)
        self.tokens_out = 0  # tokens placed in rows, with the BOS and overlap that start a piece
        self.tokens_cropped = 0  # document tokens discarded, never placed
        self.rows = 0
        self.docs_placed = 0  # documents and pieces (whole or cropped) that went into rows
        self.max_docs_per_row = 0
        self.tokens_masked = 0
        self.tokens_bos_added = 0  # the BOS in front of each placed piece that continues a document
        self.tokens_repeated = 0  # overlap tokens placed a second time (their targets are masked)
        self.tokens_continued = 0  # placed tokens of pieces that continue a document (start > 0)
        self.docs_split = 0  # documents cut into pieces

    def fill(self, rows: np.ndarray, refill: Refill, buffer_size: int) -> None:
        """Fill every row of `rows` (shape (n, row_capacity)), refilling the buffer to at least
        `buffer_size` documents before each placement, as nanochat's loader does. A refill that
        returns nothing means the walk has ended: the buffer is drained (the caller makes sure
        it holds enough tokens to finish the rows)."""
        capacity, trace, add, place = self.row_capacity, self.trace, self.add, self._place
        assert rows.shape[1] == capacity
        self.starts, self.masked = [], []
        for r, row in enumerate(rows):
            pos, starts = 0, []
            if trace is not None:
                trace.append([])
            while pos < capacity:
                while self._num_docs < buffer_size:
                    added = False
                    for doc, key, overlap, start in refill():
                        added = True
                        add(doc, key, overlap, start)
                    if not added:  # a finite walk ran out: place from what is left
                        break
                start = pos
                pos, key, piece, masked = place(row, pos)
                starts.append(start)
                if trace is not None:
                    trace[-1].append((key, piece))
                if masked:
                    # the targets that predict the repeated tokens (row positions
                    # start+1..start+masked, so targets start..start+masked-1), as far as the
                    # document made it into the row
                    end = min(start + masked, pos - 1)
                    if end > start:
                        self.masked.append((r, start, end))
                        self.tokens_masked += end - start
            self.starts.append(starts)
            self.rows += 1
            self.docs_placed += len(starts)
            self.max_docs_per_row = max(self.max_docs_per_row, len(starts))

    def add(self, doc: np.ndarray, key=None, overlap: int = 0, start: int | None = None) -> None:
        """Buffer a document, cut into pieces if the policy splits and it is longer than a row; or,
        with `start`, only its piece from that token (what buffered() reported: add_piece).
        `key` names it (e.g. where it was read) in buffered() and traces; `overlap`: how many
        tokens after its BOS repeat the previous window of the same document (their targets are
        masked)."""
        if start is not None:
            self.add_piece(doc, key, overlap, start)
            return
        n = len(doc)
        if n == 0:
            raise ValueError("cannot pack an empty document (every document starts with BOS)")
        self.tokens_in += n
        if n <= self.row_capacity or self.policy == "crop":
            self._push(doc, key, overlap, None)
            return
        self.docs_split += 1
        start = 0
        while start < n:
            end = min(n, next_cut(start, self.row_capacity, self.overlap))
            # a view up to the cut: the piece takes the BOS (token 0) and [start - overlap, end)
            self._push(doc[:end], key, overlap, start)
            start = end

    def add_piece(self, doc: np.ndarray, key, overlap: int, start: int) -> None:
        """Buffer the one piece of `doc` that begins at token `start` (what buffered() reported)."""
        n = len(doc)
        check_piece_start(start, n)
        end = n  # "crop" never cuts: the piece runs to the document's end
        if self.policy != "crop":  # a split policy cuts it on the grid, as add() does
            end = min(n, next_cut(start, self.row_capacity, self.overlap))
        self.tokens_in += end - start
        self._push(doc[:end], key, overlap, start)

    def _push(self, doc: np.ndarray, key, overlap: int, start: int | None) -> None:
        """Buffer doc (a whole document, or the piece of it from `start` to its end)."""
        # a piece's length in a row: its BOS, the overlap before `start`, then the rest
        n = len(doc) if not start else len(doc) - max(1, start - self.overlap) + 1
        if n <= self.row_capacity:
            bucket = self._by_length.get(n)
            if bucket is None:
                bucket = self._by_length[n] = deque()
                self._fit_mask |= 1 << n
            bucket.append((self._seq, doc))
        else:
            heapq.heappush(self._long, (n, self._seq, doc))
        self._keys[self._seq] = key
        if overlap:  # most documents have none: the dicts stay small
            self._overlaps[self._seq] = overlap
        if start is not None:
            self._starts[self._seq] = start
        self._seq += 1
        self._num_docs += 1

    def place(self, row: np.ndarray, pos: int) -> int:
        """Place one document into row[pos:] by the best-fit rule; returns the new position."""
        return self._place(row, pos)[0]

    def _place(self, row: np.ndarray, pos: int) -> tuple[int, object, int | None, int]:
        """place(), also returning the placed document's key, piece start, and how many tokens
        after its BOS repeat earlier ones (their targets are masked)."""
        remaining = self.row_capacity - pos
        fits = self._fit_mask & ((2 << remaining) - 1)  # lengths 1..remaining
        if fits:
            n = fits.bit_length() - 1  # the largest that fits
            seq, doc = self._pop_length(n)
            m = n
        else:  # nothing fits: crop the shortest (every short document is shorter than a long one)
            if self._fit_mask:
                n = (self._fit_mask & -self._fit_mask).bit_length() - 1  # the lowest set bit
                seq, doc = self._pop_length(n)
            elif self._long:
                n, seq, doc = heapq.heappop(self._long)
            else:
                raise RuntimeError("BestFitPacker.place called with an empty buffer")
            m = remaining
        self._num_docs -= 1
        key, window = self._keys.pop(seq), self._overlaps.pop(seq, 0)
        start = self._starts.pop(seq, None) if self._starts else None  # skip the lookup under crop
        if not start:  # a whole document, or its first piece
            row[pos:pos + m] = doc if m == n else doc[:m]  # (no view made for a whole document)
            masked = window
            placed_to = m  # the document's tokens [0, m) are placed
        else:  # BOS, then the document from a = start - overlap (the repeated tokens, then new)
            a = max(1, start - self.overlap)  # never before token 1: token 0 is the BOS itself
            row[pos] = doc[0]
            row[pos + 1:pos + m] = doc[a:a + m - 1]
            self.tokens_bos_added += 1
            self.tokens_repeated += min(m - 1, start - a)
            self.tokens_continued += m
            # mask the repeated tokens, and what is left of a pretokenized window's own overlap
            masked = max(start, min(1 + window, len(doc))) - a
            placed_to = max(start, a + m - 1)
        self.tokens_out += m
        if m < n:  # cropped: the document's tokens [placed_to, len(doc)) did not fit
            if self.policy == "split_reuse":  # they go back as a piece
                self.docs_split += start is None  # a whole document's first cut splits it
                self._push(doc, key, window, placed_to)
            else:
                self.tokens_cropped += len(doc) - placed_to
        return pos + m, key, start, masked

    def _pop_length(self, n: int) -> tuple[int, np.ndarray]:
        bucket = self._by_length[n]
        seq, doc = bucket.popleft()
        if not bucket:  # no document of length n left: its bit goes
            del self._by_length[n]
            self._fit_mask &= ~(1 << n)
        return seq, doc

    def __len__(self) -> int:
        return self._num_docs

    def stats(self) -> dict:
        """Running totals: what entered the buffer, what went out in rows, what was cropped away."""
        # the BOS and overlap in front of a piece are placed but are no document's new tokens
        document_tokens_out = self.tokens_out - self.tokens_bos_added - self.tokens_repeated
        return {
            "tokens_tokenized": self.tokens_in,
            "tokens_emitted": self.tokens_out,
            "tokens_cropped": self.tokens_cropped,
            # the share of the tokens taken from the buffer that were thrown away
            "crop_share": self.tokens_cropped / max(1, document_tokens_out + self.tokens_cropped),
            "tokens_masked": self.tokens_masked,
            "tokens_bos_added": self.tokens_bos_added,
            "tokens_repeated": self.tokens_repeated,
            "docs_split": self.docs_split,
            # emitted tokens whose own document starts in the same row (1.0 under "crop")
            "doc_start_visible_share": 1 - self.tokens_continued / max(1, self.tokens_out),
            "docs_per_row_mean": self.docs_placed / max(1, self.rows),
            "docs_per_row_max": self.max_docs_per_row,
            "buffer_docs": self._num_docs,
            "buffer_tokens": self.tokens_in - document_tokens_out - self.tokens_cropped,
        }

    def buffered(self) -> list[tuple[object, int | None]]:
        """(key, start) of the buffered documents in arrival order; start is None for a whole
        document, else the piece's start (add_piece(document, key, overlap, start) rebuilds it)."""
        return [(key, self._starts.get(seq)) for seq, key in self._keys.items()]

    def buffered_keys(self) -> list:
        """The keys of buffered(), alone (a C-speed copy: the state is built every batch)."""
        return list(self._keys.values())

    def buffered_pieces(self) -> list[list[int]]:
        """[[index in buffered(), start], ...] for the buffered pieces (empty unless the policy
        splits)."""
        if not self._starts:  # the common case, "crop": no walk over the buffer every batch
            return []
        return [[i, self._starts[seq]] for i, seq in enumerate(self._keys) if seq in self._starts]


# -----------------------------------------------------------------------------
# Concatenation


class ConcatPacker:
    """Documents back to back as one sequence of tokens, read in windows that overlap by one token:
    `take` copies the next len(out) tokens but consumes all but the last, which it only peeks (so
    the last target of one batch is the first input of the next, and no token of the sequence is
    skipped).

    Counters: tokens_in counts tokens that entered the sequence, tokens_out tokens consumed (each
    once; a peeked token counts when it is consumed), so tokens_in == tokens_out + len(self)."""

    COUNTERS = ("tokens_in", "tokens_out")

    def __init__(self):
        self._docs: deque = deque()  # (tokens, key, start) not yet fully consumed; start: see add()
        self._offset = 0  # tokens of the first entry already consumed
        self._num_tokens = 0  # tokens buffered and not yet consumed, the peeked one included
        self.tokens_in = 0
        self.tokens_out = 0

    def __len__(self) -> int:
        return self._num_tokens

    def stats(self) -> dict:
        return {"tokens_tokenized": self.tokens_in, "tokens_emitted": self.tokens_out,
                "tokens_cropped": 0, "crop_share": 0.0, "buffer_tokens": self._num_tokens}

    def buffered_keys(self) -> list:
        """Keys of the entries not yet fully consumed, in order (`offset` tokens of the first
        are)."""
        return [key for _, key, _ in self._docs]

    def buffered_pieces(self) -> list[list[int]]:
        """[[index in buffered_keys(), start], ...] for the entries that are the rest of a
        document."""
        return [[i, start] for i, (_, _, start) in enumerate(self._docs) if start is not None]

    @property
    def offset(self) -> int:
        return self._offset

    def add(self, doc: np.ndarray, key=None, overlap: int = 0, start: int | None = None) -> None:
        """Append a document to the sequence, or with `start` only its tokens from there on (the
        rest of a document an elastic merge dealt out). A window's overlap goes in as it is: the
        concatenating loader does not mask."""
        if start is not None:
            check_piece_start(start, len(doc))
            doc = doc[start:]
        if len(doc):  # an empty entry at the head could not be peeked (take's last token)
            self._docs.append((doc, key, start))
            self._num_tokens += len(doc)
            self.tokens_in += len(doc)

    def skip_consumed(self, offset: int) -> None:
        """Mark the first `offset` tokens of the first buffered entry as already consumed (a resume
        rebuilds the buffer from whole entries)."""
        assert self._offset == 0 and (not self._docs or offset < len(self._docs[0][0]))
        self._offset = offset
        self._num_tokens -= offset

    def take(self, out: np.ndarray, refill: Refill) -> None:
        """Fill the 1-D array `out` with the next len(out) tokens of the sequence, refilling while
        fewer are buffered; consume len(out) - 1 of them: the last stays first in the sequence."""
        needed = len(out)
        while self._num_tokens < needed:
            for doc, key, overlap, start in refill():
                self.add(doc, key, overlap, start)
        pos = 0
        while pos < needed - 1:
            doc = self._docs[0][0]
            n = min(len(doc) - self._offset, needed - 1 - pos)
            out[pos:pos + n] = doc[self._offset:self._offset + n]
            pos += n
            self._offset += n
            if self._offset == len(doc):
                self._docs.popleft()
                self._offset = 0
        out[pos] = self._docs[0][0][self._offset]  # peeked: the next take starts with it
        self._num_tokens -= needed - 1
        self.tokens_out += needed - 1


# -----------------------------------------------------------------------------
# Long documents: where they are cut


POLICIES = ("crop", "split", "split_reuse")


def next_cut(start: int, capacity: int, overlap: int) -> int:
    """Where the piece of a document that begins at token `start` ends (exclusive), on the fixed
    grid of cuts capacity, capacity + step, capacity + 2 step, ... with step = capacity - 1 -
    overlap: piece 0 is tokens [0, capacity) (its own BOS first); every later piece is BOS, the
    `overlap` tokens before its start again, then step new tokens, so every piece is at most
    `capacity` long. GPT-Simple's windowing (max_length = capacity) cuts at the same places."""
    if start < capacity:
        return capacity
    step = capacity - 1 - overlap  # the BOS and the overlap take the rest of a piece
    return capacity + ((start - capacity) // step + 1) * step


def check_long_doc_policy(policy: str, overlap: int, T: int) -> None:
    """Raise ValueError unless (long_doc_policy, split_overlap) are valid for rows of T+1 tokens."""
    if policy not in POLICIES:
        raise ValueError(f"long_doc_policy must be one of {POLICIES}, got {policy!r}")
    check_int("split_overlap", overlap, 0, T - 1,
              hint=" (at most T-1: each piece needs a new token)")
    if overlap and policy == "crop":
        raise ValueError("split_overlap needs long_doc_policy='split' or 'split_reuse' "
                         "(crop never splits)")


def check_piece_start(start: int, n: int) -> None:
    """Raise ValueError unless a piece of an n-token document can start at token `start`."""
    if not 0 <= start < n:
        raise ValueError(f"a piece starting at token {start} of a {n}-token document: the state "
                         "does not match the data or the tokenizer")


# -----------------------------------------------------------------------------
# Storage


def token_dtype(vocab_size: int | None) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a vocabulary (uint32 when unknown)."""
    if vocab_size is not None and vocab_size <= 2**16:
        return np.dtype(np.uint16)  # half the buffer's bytes of uint32
    return np.dtype(np.uint32)

"""
Slow, obviously-correct references for the loaders, written from nanochat's description of its
best-fit and concatenating loaders with plain Python lists and linear scans. The fast loaders must
reproduce them token for token.
"""

import pyarrow.parquet as pq

from nanochat.data.base.shuffle import permute, round_keys


def document_batches(paths, tokenizer_batch_size, rank, world_size, resume=None):
    """nanochat's _document_batches: files in order, row groups rank, rank+world_size, ...,
    slices of tokenizer_batch_size texts, forever; resume skips the saved row group."""
    resume_pq_idx = resume["pq_idx"] if resume else 0
    resume_rg_idx = resume["rg_idx"] if resume else None
    epoch = resume.get("epoch", 1) if resume else 1
    first_pass = True
    while True:
        pq_idx = resume_pq_idx if first_pass else 0
        while pq_idx < len(paths):
            pf = pq.ParquetFile(paths[pq_idx])
            if first_pass and resume_rg_idx is not None and pq_idx == resume_pq_idx:
                base_idx = resume_rg_idx // world_size + 1  # advance by 1: no repeats
                rg_idx = base_idx * world_size + rank
                if rg_idx >= pf.num_row_groups:
                    pq_idx += 1
                    continue
                resume_rg_idx = None
            else:
                rg_idx = rank
            while rg_idx < pf.num_row_groups:
                texts = pf.read_row_group(rg_idx).column("text").to_pylist()
                for i in range(0, len(texts), tokenizer_batch_size):
                    yield texts[i:i + tokenizer_batch_size], (pq_idx, rg_idx, epoch)
                rg_idx += world_size
            pq_idx += 1
        first_pass = False
        epoch += 1


def shuffled_document_batches(paths, tokenizer_batch_size, rank, world_size, seed, window):
    """The shuffled walk (shuffle=True), one element at a time: per epoch, list every row group of
    the split in file order, take positions rank, rank + world_size, ... of the epoch's
    permutation of them, and read their texts `window` row groups at a time, in the order that
    window's permutation gives, cut into batches of tokenizer_batch_size; forever. The keyed
    permutation pi itself (nanochat/data/base/shuffle.py's permute) is the one thing taken from
    the library: it is the definition of the order."""
    units = [(p, g) for p, path in enumerate(paths)
             for g in range(pq.ParquetFile(path).num_row_groups)]
    epoch = 1
    while True:
        unit_keys = round_keys(seed, "", "units", epoch)
        mine = [units[int(permute([k], len(units), unit_keys)[0])]
                for k in range(rank, len(units), world_size)]
        for w in range(0, len(mine), window):
            texts = []
            for p, g in mine[w:w + window]:
                texts += pq.ParquetFile(paths[p]).read_row_group(g).column("text").to_pylist()
            entry_keys = round_keys(seed, "", "entries", epoch, world_size, rank, w // window)
            shuffled = [texts[int(permute([i], len(texts), entry_keys)[0])]
                        for i in range(len(texts))]
            for i in range(0, len(shuffled), tokenizer_batch_size):
                yield shuffled[i:i + tokenizer_batch_size], (None, None, epoch)
        epoch += 1


def bestfit_rows(doc_buffer, refill, B, row_capacity, buffer_size):
    """nanochat's best-fit for one batch: returns B rows (lists) and the tokens cropped away."""
    rows, cropped = [], 0
    for _ in range(B):
        row = []
        while len(row) < row_capacity:
            while len(doc_buffer) < buffer_size:
                refill()
            remaining = row_capacity - len(row)
            best = None  # the largest document that fits; strict > keeps the earliest on ties
            for i, doc in enumerate(doc_buffer):
                if len(doc) <= remaining and (best is None or len(doc) > len(doc_buffer[best])):
                    best = i
            if best is not None:
                row.extend(doc_buffer.pop(best))
            else:  # crop the shortest; min() keeps the earliest on ties
                shortest = min(range(len(doc_buffer)), key=lambda i: len(doc_buffer[i]))
                doc = doc_buffer.pop(shortest)
                row.extend(doc[:remaining])
                cropped += len(doc) - remaining
        rows.append(row)
    return rows, cropped


def bestfit_loader(tokenizer, paths, B, T, tokenizer_batch_size=128, buffer_size=1000,
                   rank=0, world_size=1, resume=None, batches=None):
    """Yield (inputs, targets, state) as lists of lists, forever.
    batches: another walk of the documents."""
    batches = batches or document_batches(paths, tokenizer_batch_size, rank, world_size, resume)
    bos = tokenizer.get_bos_token_id()
    doc_buffer = []
    position = [(0, 0, 1)]

    def refill():
        texts, position[0] = next(batches)
        doc_buffer.extend(tokenizer.encode(texts, prepend=bos))

    while True:
        rows, _ = bestfit_rows(doc_buffer, refill, B, T + 1, buffer_size)
        pq_idx, rg_idx, epoch = position[0]
        yield ([r[:-1] for r in rows], [r[1:] for r in rows],
               {"pq_idx": pq_idx, "rg_idx": rg_idx, "epoch": epoch})


def concat_loader(tokenizer, paths, B, T, tokenizer_batch_size=128, rank=0, world_size=1,
                  resume=None, batches=None):
    """The concatenating loader as nanochat 3c3a3d7 has it (popping all B*T+1 tokens would skip one
    per batch): each batch reads the next B*T+1 tokens of the stream but drops only B*T, so its
    last target is the next batch's first input. batches: another walk of the documents."""
    batches = batches or document_batches(paths, tokenizer_batch_size, rank, world_size, resume)
    bos = tokenizer.get_bos_token_id()
    token_buffer = []
    needed = B * T + 1
    while True:
        while len(token_buffer) < needed:
            texts, (pq_idx, rg_idx, epoch) = next(batches)
            for tokens in tokenizer.encode(texts, prepend=bos):
                token_buffer.extend(tokens)
        tokens, token_buffer = token_buffer[:needed], token_buffer[B * T:]
        inputs = [tokens[r * T:(r + 1) * T] for r in range(B)]
        targets = [tokens[r * T + 1:(r + 1) * T + 1] for r in range(B)]
        yield inputs, targets, {"pq_idx": pq_idx, "rg_idx": rg_idx, "epoch": epoch}


# -----------------------------------------------------------------------------
# Long-document policies, token by token: every token carries where it came from


def split_document(doc, doc_id, capacity, overlap, window=0):
    """A document as (token, doc_id, position, kind, masked) tokens, cut like this: the first
    piece is its first `capacity` tokens; each later piece is a BOS, the `overlap` tokens before its
    first new token again ("copy", masked), then up to capacity-1-overlap new tokens. kind: "doc"
    (the document's own token: emitted once, or cropped), "bos" (an added BOS), "copy" (a repeat).
    window: the document is a pretokenized window whose tokens 1..window repeat the previous
    window."""
    tokens = [(t, doc_id, p, "doc", 1 <= p <= window) for p, t in enumerate(doc)]
    if len(doc) <= capacity:
        return [tokens]
    pieces = [tokens[:capacity]]
    p = capacity  # the next new token
    while p < len(doc):
        end = min(p + capacity - 1 - overlap, len(doc))
        pieces.append(continuation(doc, doc_id, p, overlap) + tokens[p:end])
        p = end
    return pieces


def continuation(doc, doc_id, p, overlap):
    """The head of a piece that continues a document at position p: BOS, then the overlap (never the
    document's own BOS at position 0)."""
    copies = [(doc[q], doc_id, q, "copy", True) for q in range(max(1, p - overlap), p)]
    return [(doc[0], doc_id, None, "bos", False)] + copies


def bestfit_policy_rows(buffer, refill, B, capacity, buffer_size, policy, overlap, docs):
    """nanochat's best-fit over pieces (lists of tagged tokens) under a long-document policy.
    refill() appends pieces to `buffer`; docs maps doc_id -> the document's tokens (for the overlap
    of a reused rest). Returns (rows of tagged tokens, tokens cropped)."""
    rows, cropped = [], 0
    for _ in range(B):
        row = []
        while len(row) < capacity:
            while len(buffer) < buffer_size:
                refill()
            remaining = capacity - len(row)
            best = None
            for i, piece in enumerate(buffer):
                if len(piece) <= remaining and (best is None or len(piece) > len(buffer[best])):
                    best = i
            if best is not None:
                row.extend(buffer.pop(best))
                continue
            piece = buffer.pop(min(range(len(buffer)), key=lambda i: len(buffer[i])))
            row.extend(piece[:remaining])
            # the document's own tokens left
            rest = [t for t in piece[remaining:] if t[3] == "doc"]
            if policy == "split_reuse" and rest:
                doc_id, p = rest[0][1], rest[0][2]
                buffer.append(continuation(docs[doc_id], doc_id, p, overlap) + rest)
            else:
                cropped += len(rest)
        rows.append(row)
    return rows, cropped


def bestfit_policy_loader(tokenizer, paths, B, T, tokenizer_batch_size, buffer_size, rank,
                          world_size, policy, overlap):
    """bestfit_loader under a long-document policy. Yields (inputs, targets, cropped so far) as
    lists; targets that predict a repeated token are -100."""
    batches = document_batches(paths, tokenizer_batch_size, rank, world_size)
    bos = tokenizer.get_bos_token_id()
    buffer, docs, cropped = [], {}, 0

    def refill():
        texts, _ = next(batches)
        for tokens in tokenizer.encode(texts, prepend=bos):
            doc_id = len(docs)
            docs[doc_id] = tokens
            capacity = T + 1 if policy != "crop" else len(tokens)  # crop never cuts
            buffer.extend(split_document(tokens, doc_id, capacity, overlap))

    while True:
        rows, n = bestfit_policy_rows(buffer, refill, B, T + 1, buffer_size, policy, overlap, docs)
        cropped += n
        yield ([[t[0] for t in row[:-1]] for row in rows],
               [[-100 if t[4] else t[0] for t in row[1:]] for row in rows], cropped)

"""
Tokenization: texts -> documents, each a numpy array of token ids that starts with BOS, stored in the
narrowest dtype the vocabulary allows (2 bytes a token up to 65,536 ids).

Encoder wraps any tokenizer with get_bos_token_id() and encode(texts, prepend=bos, num_threads=n)
(encode_to_arrays, when it has one) and checks what it returns; ShardDocs is the pretokenized loaders'
counterpart (entries are already tokens: it prepends BOS where an entry lacks one). token_batches runs
either over a stream's document batches.

May import: nanochat.packing.
"""

import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from nanochat.packing import token_dtype

# A tokenizer that returns lists (nanochat's, any duck-typed one) costs the loader a conversion per token:
# struct packs a document's Python ints into the storage dtype in one C loop, ~14 ns a token inside the
# loader against ~33 for np.asarray to int64, a min/max and astype, and refuses, with struct.error, an id
# that is not an int (a float, a str) or does not fit the dtype
_FORMATS = {np.dtype(np.uint16): "H", np.dtype(np.uint32): "I"}
assert all(struct.calcsize(code) == dtype.itemsize for dtype, code in _FORMATS.items())


def to_documents(token_lists, bos: int, dtype: np.dtype) -> list[np.ndarray]:
    """Check the tokenizer's output and store each document compactly."""
    if not isinstance(token_lists, (list, tuple)):
        raise TypeError(f"tokenizer.encode must return a list of token-id lists, got {type(token_lists).__name__}")
    limit = np.iinfo(dtype).max
    docs = []
    for ids in token_lists:
        if isinstance(ids, np.ndarray) and ids.dtype == dtype and ids.ndim == 1 and ids.size and ids[0] == bos:
            docs.append(ids)  # already compact (encode_to_arrays): every value fits by its dtype
            continue
        if isinstance(ids, (list, tuple)):
            arr = _list_to_array(ids, dtype, limit)
        elif isinstance(ids, np.ndarray):
            if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
                raise TypeError(f"tokenizer.encode must return lists of ints, got an array of {ids.dtype}")
            if ids.size and (ids.min() < 0 or ids.max() > limit):
                raise _out_of_range(dtype, limit)
            arr = ids.astype(dtype)
        else:
            raise TypeError(f"tokenizer.encode must return lists of ints, got an element of type {type(ids).__name__}")
        if arr.size == 0 or arr[0] != bos:
            raise ValueError("tokenizer.encode(texts, prepend=bos) returned a document that does not start "
                             f"with the BOS token {bos}; every document must start with BOS")
        docs.append(arr)
    return docs


def _list_to_array(ids, dtype: np.dtype, limit: int) -> np.ndarray:
    try:
        packed = struct.Struct(f"{len(ids)}{_FORMATS[dtype]}").pack(*ids)
    except (struct.error, OverflowError, TypeError):
        bad = next((type(i).__name__ for i in ids if not isinstance(i, (int, np.integer))), None)
        if bad is not None:
            raise TypeError(f"tokenizer.encode must return lists of ints, got a list holding {bad}") from None
        raise _out_of_range(dtype, limit) from None
    return np.frombuffer(packed, dtype=dtype).copy()  # owns its memory and is writable, as astype's result was


def _out_of_range(dtype: np.dtype, limit: int) -> ValueError:
    return ValueError(f"token id out of range [0, {limit}] for {dtype} storage: "
                      "tokenizer.get_vocab_size() is smaller than the ids it produces")


class Encoder:
    """texts -> checked numpy documents with BOS first, in the narrowest dtype the vocabulary allows."""

    def __init__(self, tokenizer, tokenizer_threads: int):
        self.bos = tokenizer.get_bos_token_id()
        vocab_size = tokenizer.get_vocab_size() if hasattr(tokenizer, "get_vocab_size") else None
        self.dtype = token_dtype(vocab_size)
        # a tokenizer that can return numpy arrays (ours can) skips building a Python int per token;
        # ours may also be called from two threads at once (its thread pool is shared and locked).
        # One that returns lists is called one batch at a time, even where two calls would be safe
        # (nanochat's RustBPETokenizer): tiktoken starts a thread pool per call, and two calls at once
        # took 10-30% more CPU per token and lowered the loader's throughput (0.69-0.86 of the
        # tokenizer alone, against 0.86-0.93 one at a time, on 2 cores)
        self.encode = getattr(tokenizer, "encode_to_arrays", None) or tokenizer.encode
        self.thread_safe = hasattr(tokenizer, "encode_to_arrays")
        self.threads = tokenizer_threads

    def __call__(self, texts: list[str]) -> tuple[list[np.ndarray], list[int]]:
        """(documents, overlaps): whole documents repeat nothing."""
        docs = to_documents(self.encode(texts, prepend=self.bos, num_threads=self.threads), self.bos, self.dtype)
        return docs, [0] * len(docs)


def token_batches(doc_batches, encoder, overlap_calls: bool = False):
    """Yield (documents, keys, after, overlaps) for each document batch: the texts tokenized with BOS
    prepended (or, for pretokenized shards, the entries as they are).

    overlap_calls: start the next batch's encode call before this one returns, so the tokenizer's
    thread pool does not idle on the tail of each call (its last, longest documents). Only for a
    tokenizer that returns arrays and may be called from two threads at once (ours)."""
    if not overlap_calls:
        for items, keys, after in doc_batches:
            docs, overlaps = encoder(items)
            yield docs, keys, after, overlaps
        return
    with ThreadPoolExecutor(2, thread_name_prefix="nanochat-encode-call") as calls:
        pending: deque = deque()
        for items, keys, after in doc_batches:
            pending.append((calls.submit(encoder, items), keys, after))
            if len(pending) == 2:  # the newer call keeps running while this batch goes on
                future, keys, after = pending.popleft()
                docs, overlaps = future.result()
                yield docs, keys, after, overlaps
        while pending:
            future, keys, after = pending.popleft()
            docs, overlaps = future.result()
            yield docs, keys, after, overlaps


class ShardDocs:
    """(tokens, overlap) items -> documents that start with BOS (GPT-Simple's EOD-terminated entries
    get one prepended) and their overlaps. Rows are uint32: shards may mix uint16 and uint32.
    always: prepend BOS to every entry, also to one that starts with that id: for shards known to be
    in GPT-Simple's convention, whose EOD is our BOS id, so an entry that is a lone EOD (an empty
    document, or the last window of one) still trains its EOD."""

    dtype = np.dtype(np.uint32)

    def __init__(self, bos: int, always: bool = False):
        self.bos = bos
        self.always = always

    def __call__(self, items: list) -> tuple[list[np.ndarray], list[int]]:
        docs = [tokens if not self.always and len(tokens) and tokens[0] == self.bos
                else np.concatenate(([self.bos], tokens)) for tokens, _ in items]
        return docs, [overlap for _, overlap in items]

"""
Stand-in tokenizers for tests about packing, not BPE (the tests import them from conftest). Apart
from conftest, which imports torch and pytest: a loader's worker process unpickles its tokenizer,
and with these it imports only this module.
"""

import numpy as np


class ByteTokenizer:
    """A stand-in for tests about packing, not BPE: one token per UTF-8 byte, BOS = 256."""

    bos = 256

    def get_bos_token_id(self):
        return self.bos

    def get_vocab_size(self):
        return 257

    def encode(self, texts, prepend=None, num_threads=1):
        def one(text):
            ids = list(text.encode("utf-8"))
            return ([prepend] if prepend is not None else []) + ids
        if isinstance(texts, str):
            return one(texts)
        return [one(t) for t in texts]

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class ByteArrayTokenizer(ByteTokenizer):
    """ByteTokenizer with encode_to_arrays (uint32 arrays), as pretokenize asks of a tokenizer."""

    def encode_to_arrays(self, texts, prepend=None, num_threads=1):
        return [np.array(ids, dtype=np.uint32) for ids in self.encode(texts, prepend=prepend)]

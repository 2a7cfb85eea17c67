"""
A tokenizer that returns lists, as nanochat's does, for the benchmarks. It lives in a module of
its own: a loader's worker process gets its tokenizer by pickle, and pickle finds a class by its
module's name, which a script run with `python -m` does not have (it is `__main__`).
"""

from nanochat.tokenizer import RustBPETokenizer


class ListTokenizer:
    """Our tokenizer as the loader sees nanochat's own RustBPETokenizer, or any duck-typed one:
    only get_bos_token_id, get_vocab_size and encode(texts, prepend=bos, num_threads=n), which
    returns lists of Python ints (tiktoken's encode_ordinary_batch, then BOS inserted at the front
    of each list, as nanochat's does); no encode_to_arrays, so the loader converts the lists
    itself."""

    def __init__(self, tokenizer: RustBPETokenizer):
        self._tokenizer = tokenizer

    def get_bos_token_id(self) -> int:
        return self._tokenizer.get_bos_token_id()

    def get_vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, texts, prepend=None, num_threads: int = 8) -> list[list[int]]:
        return self._tokenizer.encode(texts, prepend=prepend, num_threads=num_threads)

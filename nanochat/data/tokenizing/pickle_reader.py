"""
Reading nanochat's tokenizer.pkl without running it.
Reading nanochat's tokenizer.pkl without running it: a pickle may name any function to call, so
the unpickler admits one global, tiktoken's Encoding, kept as plain data, and refuses any other
before it exists. A damaged file is a ValueError naming it and the fix.

Cost: one read of the file; nothing in it runs.

May import: nanochat.data.tokenizing.tokenizer_files.
"""

import pickle

from nanochat.data.tokenizing.tokenizer_files import TRAIN_HINT


class UnsafePickleError(pickle.UnpicklingError, ValueError):
    """A tokenizer.pkl asked for something other than tiktoken's Encoding class; nothing was run."""


def read_pickled_encoding(path: str) -> dict:
    """The state that tiktoken's Encoding pickles (name, pat_str, mergeable_ranks,
    special_tokens)."""
    try:
        with open(path, "rb") as f:
            obj = _EncodingUnpickler(f, path).load()
    except UnsafePickleError:
        raise
    # a damaged pickle fails in many ways inside the unpickler, each meaning the same to the caller
    # (MemoryError too: a damaged length field can ask for a huge buffer; 27 of 3,000 byte-flip
    # trials)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, OverflowError, MemoryError) as e:
        raise ValueError(f"{path} is not a valid pickled tokenizer ({type(e).__name__}: {e}); "
                         f"retrain it: {TRAIN_HINT}") from e
    if not isinstance(obj, _EncodingState):
        raise ValueError(f"{path} holds a {type(obj).__name__}, not a pickled tiktoken Encoding; "
                         f"retrain the tokenizer: {TRAIN_HINT}")
    state = obj.state
    if isinstance(state, str):
        # tiktoken pickles its own registered encodings by name only
        raise ValueError(f"{path} names tiktoken's encoding {state!r} instead of holding its "
                         f"tables; load it with RustBPETokenizer.from_pretrained({state!r})")
    keys = {"name", "pat_str", "mergeable_ranks", "special_tokens"}
    if not isinstance(state, dict) or set(state) != keys:
        got = list(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path} holds a tiktoken Encoding whose state is not {sorted(keys)} (got "
                         f"{got}); retrain the tokenizer: {TRAIN_HINT}")
    return state


class _EncodingState:
    """Stands in for tiktoken.core.Encoding while unpickling: it keeps the pickled state, runs
    nothing."""

    state = None

    def __setstate__(self, state) -> None:
        self.state = state


class _EncodingUnpickler(pickle.Unpickler):
    """Unpickles a tiktoken Encoding as an _EncodingState. Its pickle (protocol 3 and up) names one
    global, tiktoken.core.Encoding; everything else is plain data (dicts, str, bytes, int). Any
    other global could be a function to call (os.system, builtins.exec), so it is refused before it
    exists."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) == ("tiktoken.core", "Encoding"):
            return _EncodingState
        raise UnsafePickleError(
            f"{self.path} refers to {module}.{name}, but a nanochat tokenizer.pkl refers only to "
            "tiktoken.core.Encoding; refused without running anything. Retrain the tokenizer "
            f"({TRAIN_HINT}) or get the file from where it was trained")

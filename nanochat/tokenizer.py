"""
GPT-4-style BPE tokenizer: trained with rustbpe, run with tiktoken, saved as plain JSON.
Its files are tokenizer.json and token_bytes.npy. It has nanochat's API (RustBPETokenizer,
train_from_iterator, from_directory, encode, render_conversation, ...), so it can replace
nanochat/tokenizer.py in a nanochat checkout. It reads nanochat's tokenizer.pkl without running it;
`python -m nanochat.tokenizer convert DIR` turns one into tokenizer.json, `export-hf DIR` writes a
Hugging Face tokenizer.json.

Cost: training on ~2B characters takes minutes; encoding runs at tiktoken speed (MB/s per thread).
Design and file formats: docs/tokenizer.md

May import: nanochat.data.base.checks, nanochat.data.base.cli, nanochat.common,
nanochat.data.tokenizing, tiktoken, numpy.
Imported only when needed: rustbpe (training), torch (get_token_bytes): importing the tokenizer
stays light, as a pretokenize worker or a tokenizer CLI needs it.
"""

import argparse
import base64
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tiktoken

from nanochat.common import get_base_dir
from nanochat.data.base.checks import check_int
from nanochat.data.base.cli import run
from nanochat.data.tokenizing.hf_export import export_hf, hf_json
from nanochat.data.tokenizing.pickle_reader import read_pickled_encoding
from nanochat.data.tokenizing.tables import check_tables
from nanochat.data.tokenizing.tokenizer_files import (FORMAT_NAME, FORMAT_VERSION, PICKLE_FILENAME,
                                                       TOKEN_BYTES_FILENAME, TOKENIZER_FILENAME,
                                                       TRAIN_HINT, write_atomic)

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = [
    # every document begins with the Beginning of Sequence token, which also delimits documents
    "<|bos|>",
    # the chat format (used at finetuning time)
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",  # the assistant invokes the python tool
    "<|python_end|>",
    "<|output_start|>",  # the tool's output comes back to the assistant
    "<|output_end|>",
]

# GPT-4's split pattern, except that numbers split into runs of at most 2 digits (GPT-4 uses 3):
# fewer number tokens to spend the vocab on, which matters for small vocabs
SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}|"""
                 r""" ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")

MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus our specials: 265
CONVERT_HINT = "python -m nanochat.tokenizer convert"

# how each kind of assistant part is rendered: (opening special, closing special, mask of the part)
# tool output is written by the interpreter at inference time, so the model never learns to
# produce it
_PARTS = {
    "text": (None, None, 1),
    "python": ("<|python_start|>", "<|python_end|>", 1),
    "python_output": ("<|output_start|>", "<|output_end|>", 0),
}
# ANSI colours for visualize_tokenization
_GREEN, _RED, _GRAY, _RESET = "\033[92m", "\033[91m", "\033[90m", "\033[0m"

# -----------------------------------------------------------------------------
# The tokenizer


class RustBPETokenizer:
    """A tiktoken Encoding (for fast encoding) and the name of its BOS token; trained with
    rustbpe."""

    def __init__(self, enc: tiktoken.Encoding, bos_token: str):
        if not isinstance(enc, tiktoken.Encoding):
            raise TypeError(f"enc must be a tiktoken.Encoding, got {type(enc).__name__}")
        if bos_token not in enc.special_tokens_set:
            raise ValueError(f"bos_token {bos_token!r} is not among the special tokens "
                             f"{sorted(enc.special_tokens_set)} of encoding {enc.name!r}")
        self.enc = enc
        # tiktoken keeps its tables in private attributes; this is the one place we read them (save
        # needs them)
        self.name = enc.name
        self.pattern = enc._pat_str
        self.mergeable_ranks = enc._mergeable_ranks
        self.special_tokens = enc._special_tokens
        self.bos_token = bos_token
        self.bos_token_id = self.special_tokens[bos_token]

    # -------------------------------------------------------------------------
    # Constructors

    @classmethod
    def train_from_iterator(cls, text_iterator, vocab_size: int, *, buffer_size: int = 8192):
        """Train on the strings that text_iterator yields. vocab_size counts the special tokens.
        If the text runs out of pairs to merge, the vocab comes out smaller (a warning says so)."""
        # not an integer: TypeError; too small: ValueError
        vocab_size = check_int("vocab_size", vocab_size, error=TypeError)
        check_int("vocab_size", vocab_size, MIN_VOCAB_SIZE,
                  hint=f" (256 byte tokens + {len(SPECIAL_TOKENS)} special tokens)")
        import rustbpe  # only training needs it
        trainer = rustbpe.Tokenizer()
        vocab_size_no_special = vocab_size - len(SPECIAL_TOKENS)
        trainer.train_from_iterator(text_iterator, vocab_size_no_special, buffer_size=buffer_size,
                                    pattern=SPLIT_PATTERN)
        mergeable_ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
        if len(mergeable_ranks) < vocab_size_no_special:
            logger.warning("the training text ran out of pairs to merge: got %d mergeable tokens, "
                           "asked for %d", len(mergeable_ranks), vocab_size_no_special)
        offset = len(mergeable_ranks)  # the specials take the ids right after the last rank
        special_tokens = {name: offset + i for i, name in enumerate(SPECIAL_TOKENS)}
        return cls._from_tables("rustbpe", trainer.get_pattern(), mergeable_ranks, special_tokens,
                                SPECIAL_TOKENS[0])

    @classmethod
    def from_directory(cls, tokenizer_dir: str):
        """Load the tokenizer in tokenizer_dir: our tokenizer.json, else nanochat's tokenizer.pkl
        (read without running anything in it; see tokenizing/pickle_reader.py). tokenizer.json wins
        when both exist."""
        if not os.path.isdir(tokenizer_dir):
            raise FileNotFoundError(f"tokenizer directory {tokenizer_dir} does not exist; "
                                    f"train a tokenizer first: {TRAIN_HINT}"
                                    f"{_base_dir_words(tokenizer_dir)}")
        json_path = os.path.join(tokenizer_dir, TOKENIZER_FILENAME)
        pkl_path = os.path.join(tokenizer_dir, PICKLE_FILENAME)
        if os.path.exists(json_path):
            if (os.path.exists(pkl_path)
                    and os.path.getmtime(pkl_path) > os.path.getmtime(json_path)):
                # likely nanochat's tok_train wrote a new pickle over an old conversion
                logger.warning("%s is newer than %s; loading %s anyway. To use the pickle, convert "
                               "it: %s %s", pkl_path, json_path, json_path, CONVERT_HINT,
                               tokenizer_dir)
            return cls._from_json(json_path)
        if os.path.exists(pkl_path):
            return cls._from_pickle(pkl_path)
        raise FileNotFoundError(f"tokenizer file {json_path} does not exist (nor nanochat's "
                                f"{PICKLE_FILENAME}); train a tokenizer first: {TRAIN_HINT}"
                                f"{_base_dir_words(tokenizer_dir)}")

    @classmethod
    def from_pretrained(cls, tiktoken_name: str):
        """One of tiktoken's named encodings, e.g. "gpt2" or "cl100k_base" (tiktoken downloads it
        on first use). Its BOS is <|bos|> if it has one, else <|endoftext|>."""
        enc = tiktoken.get_encoding(tiktoken_name)
        for bos_token in ("<|bos|>", "<|endoftext|>"):
            if bos_token in enc.special_tokens_set:
                return cls(enc, bos_token)
        raise ValueError(f"tiktoken encoding {tiktoken_name!r} has neither <|bos|> nor "
                         f"<|endoftext|> among its special tokens {sorted(enc.special_tokens_set)}")

    @classmethod
    def _from_tables(cls, name: str, pattern: str, mergeable_ranks: dict[bytes, int],
                     special_tokens: dict[str, int], bos_token: str):
        """Build the tiktoken Encoding from tables, checked first: tables read from a file may be
        damaged, and tiktoken panics (rather than raising ValueError) on some bad ones."""
        check_tables(name, pattern, mergeable_ranks, special_tokens, bos_token)
        enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=mergeable_ranks,
                                special_tokens=special_tokens)
        return cls(enc, bos_token)

    @classmethod
    def _from_json(cls, path: str):
        try:
            with open(path, "rb") as f:
                data = json.loads(f.read().decode("utf-8"))  # bytes: a bad byte is a ValueError
            # a Hugging Face file has a "model" and no "format"; the loaders would fail on it later
            if isinstance(data, dict) and "model" in data and "format" not in data:
                raise FileNotFoundError(f"{path} is a Hugging Face tokenizer.json (export-hf "
                                        "writes these), not ours: load our tokenizer from the "
                                        "directory it was exported from")
            if data.get("format") != FORMAT_NAME:
                raise ValueError(f"'format' is {data.get('format')!r}, expected {FORMAT_NAME!r}")
            if data.get("version") != FORMAT_VERSION:
                raise ValueError(f"unsupported version {data.get('version')!r} (this code reads "
                                 f"{FORMAT_VERSION})")
            mergeable_ranks = {}
            for token_b64, rank in data["mergeable_ranks"]:
                mergeable_ranks[base64.b64decode(token_b64, validate=True)] = rank
            if len(mergeable_ranks) != len(data["mergeable_ranks"]):  # a dict keeps one of two
                raise ValueError("a mergeable token appears twice")
            return cls._from_tables(data["name"], data["pattern"], mergeable_ranks,
                                    data["special_tokens"], data["bos_token"])
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
            # ValueError covers bad JSON, bad UTF-8, bad base64 and failed table checks
            raise ValueError(f"{path} is not a valid tokenizer file ({type(e).__name__}: {e}); "
                             f"retrain it: {TRAIN_HINT}") from e

    @classmethod
    def _from_pickle(cls, path: str):
        """nanochat's tokenizer.pkl (a pickled tiktoken Encoding, BOS <|bos|>), run nothing."""
        state = read_pickled_encoding(path)
        try:
            return cls._from_tables(state["name"], state["pat_str"], state["mergeable_ranks"],
                                    state["special_tokens"], SPECIAL_TOKENS[0])
        except (ValueError, RecursionError) as e:  # RecursionError: a deeply nested table value
            raise ValueError(f"{path} holds a tiktoken Encoding with unusable tables "
                             f"({type(e).__name__}: {e}); retrain the tokenizer: "
                             f"{TRAIN_HINT}") from e

    # -------------------------------------------------------------------------
    # Saving

    def save(self, tokenizer_dir: str) -> None:
        """Write tokenizer.json and token_bytes.npy into tokenizer_dir (created if needed)."""
        os.makedirs(tokenizer_dir, exist_ok=True)
        by_rank = sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1])
        data = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "name": self.name,
            "pattern": self.pattern,
            "bos_token": self.bos_token,
            "special_tokens": dict(sorted(self.special_tokens.items(), key=lambda kv: kv[1])),
            # a list in rank order, not a dict: JSON keys are text, and tokens are any bytes
            "mergeable_ranks": [[base64.b64encode(token).decode("ascii"), rank]
                                for token, rank in by_rank],
        }
        payload = json.dumps(data, ensure_ascii=False).encode("utf-8")
        token_bytes = self.compute_token_bytes()
        # token bytes first, tokenizer.json last: a directory whose tokenizer.json is new has new
        # token bytes
        bytes_path = os.path.join(tokenizer_dir, TOKEN_BYTES_FILENAME)
        write_atomic(bytes_path, lambda f: np.save(f, token_bytes, allow_pickle=False))
        json_path = os.path.join(tokenizer_dir, TOKENIZER_FILENAME)
        write_atomic(json_path, lambda f: f.write(payload))
        logger.info("saved tokenizer (vocab size %d) to %s", self.get_vocab_size(), tokenizer_dir)

    def compute_token_bytes(self) -> np.ndarray:
        """int32 (vocab_size,): UTF-8 byte length of each token; 0 for special tokens and unused
        ids."""
        token_bytes = np.zeros(self.get_vocab_size(), dtype=np.int32)
        for token, rank in self.mergeable_ranks.items():
            token_bytes[rank] = len(token)
        return token_bytes

    # -------------------------------------------------------------------------
    # Exporting for Hugging Face tools

    def to_hf_json(self) -> dict:
        """This tokenizer as a Hugging Face `tokenizers` file (the dict that its tokenizer.json
        holds); see nanochat/data/tokenizing/hf_export.py. It encodes text as tiktoken does with
        allowed_special="all": like encode(), but special-token text becomes that token. No BOS is
        added (encode prepends none either)."""
        return hf_json(self.pattern, self.mergeable_ranks, self.special_tokens)

    def export_hf(self, out_dir: str | os.PathLike) -> list[str]:
        """Write this tokenizer for Hugging Face tools into out_dir (created if needed):
        tokenizer.json (to_hf_json) and a tokenizer_config.json that makes transformers'
        AutoTokenizer load it with our BOS as bos_token. Returns the paths written. Refuses
        (FileExistsError) to replace a tokenizer of ours (tokenizer.json in our format,
        tokenizer.pkl) or files that an earlier export did not write."""
        return export_hf(self, out_dir)

    # -------------------------------------------------------------------------
    # Encoding and decoding

    def get_vocab_size(self) -> int:
        return self.enc.n_vocab

    def get_special_tokens(self) -> set[str]:
        """The names of the special tokens (a set, as tiktoken's special_tokens_set)."""
        return self.enc.special_tokens_set

    def get_bos_token_id(self) -> int:
        return self.bos_token_id

    def encode_special(self, name: str) -> int:
        """The id of a special token, e.g. encode_special("<|bos|>") (or of any text that is one
        token)."""
        if name in self.special_tokens:
            return self.special_tokens[name]
        try:
            return self.enc.encode_single_token(name)
        except KeyError:
            names = sorted(self.special_tokens, key=self.special_tokens.get)
            raise ValueError(f"{name!r} is not a special token (nor a single token); the special "
                             f"tokens are {names}") from None

    def id_to_token(self, token_id: int) -> str:
        """The text of one token (a token holding part of a UTF-8 character decodes to U+FFFD)."""
        return self.enc.decode([token_id])

    def decode_single_token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token. Unlike id_to_token, exact for tokens that are not whole UTF-8
        characters (e.g. a lone byte 0xE4), which is why token byte counts are taken from it."""
        return self.enc.decode_single_token_bytes(token_id)

    def _special_id(self, token: str | int, what: str) -> int:
        if isinstance(token, str):
            return self.encode_special(token)
        # not an integer: TypeError; outside the vocab: ValueError
        token = check_int(what, token, hint=" id or a special token name", error=TypeError)
        return check_int(f"{what} id", token, 0, self.get_vocab_size() - 1,
                         hint=" (the vocab's ids)")

    def encode(self, text: str | list[str], prepend: str | int | None = None,
               append: str | int | None = None,
               num_threads: int = 8) -> list[int] | list[list[int]]:
        """Token ids of a str, or one list of ids per str of a list (encoded on num_threads
        threads). Special-token text inside `text` is encoded as ordinary text, never as a special
        token. prepend/append: a special token (name or id) added to each encoded text."""
        prepend_id = None if prepend is None else self._special_id(prepend, "prepend")
        append_id = None if append is None else self._special_id(append, "append")
        if isinstance(text, str):
            # ordinary: "<|bos|>" typed in a document is text, never a document boundary
            ids = self.enc.encode_ordinary(text)
            if prepend_id is not None:
                ids.insert(0, prepend_id)
            if append_id is not None:
                ids.append(append_id)
            return ids
        if isinstance(text, list):
            if not all(isinstance(t, str) for t in text):
                raise TypeError("encode takes a str or a list of str; the list holds a non-str "
                                "item")
            batch = self.enc.encode_ordinary_batch(text, num_threads=num_threads)
            for ids in batch:
                if prepend_id is not None:
                    ids.insert(0, prepend_id)
                if append_id is not None:
                    ids.append(append_id)
            return batch
        raise TypeError(f"encode takes a str or a list of str, got {type(text).__name__}")

    def encode_to_arrays(self, texts: list[str], prepend: str | int | None = None,
                         num_threads: int = 8) -> list[np.ndarray]:
        """Like encode(list_of_str, prepend=...), but each text comes back as a numpy array of the
        narrowest dtype the vocabulary allows (uint16 up to 65,536 tokens, else uint32), built from
        tiktoken's token buffer without a Python int per token. The data loader uses this when a
        tokenizer has it: it saves ~25 ns per token of list building and converting."""
        prepend_id = None if prepend is None else self._special_id(prepend, "prepend")
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise TypeError("encode_to_arrays takes a list of str")
        dtype = np.uint16 if self.get_vocab_size() <= 2**16 else np.uint32
        offset = 0 if prepend_id is None else 1

        def encode_chunk(chunk: list[str]) -> list[np.ndarray]:
            out = []
            for text in chunk:
                # disallowed_special=(): ordinary text, as encode()
                ids = self.enc.encode_to_numpy(text, disallowed_special=())
                doc = np.empty(len(ids) + offset, dtype=dtype)  # one allocation, BOS included
                if offset:
                    doc[0] = prepend_id
                doc[offset:] = ids
                out.append(doc)
            return out

        # a few texts per task: one task per text costs a thread hand-off (and a GIL hand-off) per
        # text; 4 tasks per thread still balance long and short texts
        size = max(1, -(-len(texts) // (4 * num_threads)))  # -(-a // b): a / b rounded up
        chunks = [texts[i:i + size] for i in range(0, len(texts), size)]
        return [doc for docs in self._pool(num_threads).map(encode_chunk, chunks) for doc in docs]

    def _pool(self, num_threads: int) -> ThreadPoolExecutor:
        """A thread pool kept for the tokenizer's life: starting num_threads threads per call costs
        milliseconds once other threads compete for the GIL (a loader calls this ~10 times a
        second)."""
        with _POOLS_LOCK:  # two loaders sharing one tokenizer must not start two pools
            # in __dict__, made on first use: a tokenizer built without __init__ gets one too
            pools = self.__dict__.setdefault("_pools", {})
            if num_threads not in pools:
                pools[num_threads] = ThreadPoolExecutor(num_threads,
                                                        thread_name_prefix="tokenizer-encode")
            return pools[num_threads]

    def __getstate__(self) -> dict:
        # a loader's worker process gets a copy: its thread pools are its own, made there on use
        return {k: v for k, v in self.__dict__.items() if k != "_pools"}

    def __call__(self, *args, **kwargs):
        return self.encode(*args, **kwargs)

    def decode(self, ids: list[int]) -> str:
        """Text of a list of ids; invalid UTF-8 (a cut through a character) decodes to U+FFFD."""
        return self.enc.decode(ids)

    # -------------------------------------------------------------------------
    # Chat conversations

    def render_conversation(self, conversation: dict,
                            max_tokens: int = 2048) -> tuple[list[int], list[int]]:
        """Token ids of one chat conversation, {"messages": [{"role": ..., "content": ...}, ...]},
        and a mask of the same length: 1 on the tokens the model learns to produce (the assistant's
        text and python calls, and <|assistant_end|>), 0 on the rest. Both lists are cut to
        max_tokens.

        Roles alternate user, assistant, user, ...; a leading system message is put in front of the
        first user message, separated by a blank line. A user's content is a str; an assistant's is
        a str or a list of parts {"type": "text" | "python" | "python_output", "text": str}."""
        ids, mask = [], []

        def add(token_ids: list[int], supervised: int) -> None:
            ids.extend(token_ids)
            mask.extend([supervised] * len(token_ids))

        special = self.encode_special
        add([self.bos_token_id], 0)
        for i, message in enumerate(_chat_messages(conversation)):
            role, content = message["role"], message["content"]
            expected = "user" if i % 2 == 0 else "assistant"
            if role != expected:
                raise ValueError(f"message {i} (not counting a leading system message) is from "
                                 f"{role!r} but should be from {expected!r}: roles must alternate "
                                 "user, assistant, user, ...")
            if role == "user":  # the prompt: never supervised
                if not isinstance(content, str):
                    raise ValueError(f"message {i}: a user's content must be a str, got "
                                     f"{type(content).__name__}")
                add([special("<|user_start|>")] + self.encode(content) + [special("<|user_end|>")],
                    0)
                continue
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            if not isinstance(parts, list):
                raise ValueError(f"message {i}: an assistant's content must be a str or a list of "
                                 f"parts, got {type(content).__name__}")
            add([special("<|assistant_start|>")], 0)  # given at inference: nothing to learn
            for part in parts:
                part_type = part.get("type") if isinstance(part, dict) else None
                if part_type not in _PARTS:
                    raise ValueError(f"message {i}: unknown part type {part_type!r} in {part!r}; "
                                     f"a part is a dict with a 'type' in {list(_PARTS)} and a "
                                     "'text'")
                opener, closer, supervised = _PARTS[part_type]
                opening = [] if opener is None else [special(opener)]
                closing = [] if closer is None else [special(closer)]
                add(opening + self.encode(part["text"]) + closing, supervised)
            add([special("<|assistant_end|>")], 1)  # supervised: the model must learn to stop
        # cut long conversations rather than fail: a batch must fit in memory
        return ids[:max_tokens], mask[:max_tokens]

    def render_for_completion(self, conversation: dict) -> list[int]:
        """Token ids that prompt the assistant to answer (reinforcement learning, evaluation): the
        conversation without its last message, which must be the assistant's, then
        <|assistant_start|>."""
        messages = conversation["messages"]
        if not messages or messages[-1]["role"] != "assistant":
            last = messages[-1]["role"] if messages else None
            raise ValueError(f"the last message must be the assistant's (it is dropped to leave "
                             f"room for a completion), got {last!r}")
        # a new dict with a shorter list: rendering never writes to messages, so the caller's stay
        # intact
        ids, _ = self.render_conversation(dict(conversation, messages=messages[:-1]))
        return ids + [self.encode_special("<|assistant_start|>")]

    def visualize_tokenization(self, ids: list[int], mask: list[int],
                               with_token_id: bool = False) -> str:
        """A debugging view of render_conversation's output: each token's text, green where mask is
        1 and red where it is 0, joined by '|'; with_token_id adds each id, in gray, as its own
        piece."""
        pieces = []
        for token_id, supervised in zip(ids, mask):
            color = _GREEN if supervised == 1 else _RED
            pieces.append(f"{color}{self.decode([token_id])}{_RESET}")
            if with_token_id:
                pieces.append(f"{_GRAY}({token_id}){_RESET}")
        return "|".join(pieces)


Tokenizer = RustBPETokenizer
_POOLS_LOCK = threading.Lock()

# -----------------------------------------------------------------------------
# Helpers


def _chat_messages(conversation: dict) -> list[dict]:
    """conversation["messages"] with a leading system message merged into the user message after
    it (the chat format has no system turn). Builds new dicts; the caller's are left untouched."""
    messages = conversation["messages"]
    if not messages:
        raise ValueError("the conversation has no messages")
    if messages[0]["role"] != "system":
        return messages
    if len(messages) < 2 or messages[1]["role"] != "user":
        raise ValueError("a system message must be followed by a user message")
    system, user = messages[0]["content"], messages[1]["content"]
    if not isinstance(system, str) or not isinstance(user, str):
        raise ValueError(f"a system message and the user message after it must both hold a str, "
                         f"got {type(system).__name__} and {type(user).__name__}")
    return [dict(messages[1], content=system + "\n\n" + user)] + messages[2:]


# -----------------------------------------------------------------------------
# Convenience for the rest of nanochat


def get_tokenizer_dir() -> str:
    """<base_dir>/tokenizer, resolved at call time."""
    return os.path.join(get_base_dir(), "tokenizer")


def get_tokenizer() -> RustBPETokenizer:
    """The tokenizer saved under <base_dir>/tokenizer (see get_base_dir: $NANOCHAT_BASE_DIR)."""
    return RustBPETokenizer.from_directory(get_tokenizer_dir())


def _base_dir_words(tokenizer_dir: str) -> str:
    """For a missing tokenizer in <base_dir>/tokenizer: where <base_dir> came from, and how to
    point it at another; "" for a directory passed by hand."""
    if os.path.abspath(tokenizer_dir) != os.path.abspath(get_tokenizer_dir()):
        return ""
    base_from = ("from "
                 "NANOCHAT_BASE_DIR" if os.environ.get("NANOCHAT_BASE_DIR")  # "" counts as unset
             else "~/.cache/nanochat, as NANOCHAT_BASE_DIR is unset")
    return (f". It is <base_dir>/tokenizer, with <base_dir> {base_from}; a tokenizer trained under "
            "another base dir is found with export NANOCHAT_BASE_DIR=DIR (DIR holds tokenizer/)")


def get_token_bytes(device="cpu", tokenizer_dir: str | None = None):
    """torch int32 tensor (vocab_size,) of bytes per token (0 for specials), loaded from the
    token_bytes.npy that save() wrote next to the tokenizer (default dir: <base_dir>/tokenizer).
    Also reads nanochat's token_bytes.pt (tensors only, weights_only=True)."""
    import torch  # only bits-per-byte evaluation needs it
    tokenizer_dir = get_tokenizer_dir() if tokenizer_dir is None else tokenizer_dir
    path = os.path.join(tokenizer_dir, TOKEN_BYTES_FILENAME)
    pt_path = os.path.join(tokenizer_dir, "token_bytes.pt")
    if os.path.exists(path):
        try:
            token_bytes = np.load(path, allow_pickle=False)  # no pickle: a data file runs nothing
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(f"{path} is not a valid token bytes file ({e}); retrain: "
                             f"{TRAIN_HINT}") from e
        if token_bytes.ndim != 1 or token_bytes.dtype.kind not in "iu":
            raise ValueError(f"{path} should hold a 1-D int array, got {token_bytes.dtype} of "
                             f"shape {token_bytes.shape}; retrain: {TRAIN_HINT}")
        token_bytes = torch.from_numpy(token_bytes.astype(np.int32))
    elif os.path.exists(pt_path):
        try:
            # tensors only, runs nothing
            token_bytes = torch.load(pt_path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several kinds for a damaged or non-tensor file
            raise ValueError(f"{pt_path} is not a valid token bytes file ({type(e).__name__}); "
                             "delete it and retrain, or write token_bytes.npy: python -m "
                             f"nanochat.tokenizer convert {tokenizer_dir}") from None
        if not (isinstance(token_bytes, torch.Tensor) and token_bytes.ndim == 1
                and not token_bytes.is_floating_point() and not token_bytes.is_complex()):
            got = (f"a {token_bytes.dtype} tensor of shape {tuple(token_bytes.shape)}"
                   if isinstance(token_bytes, torch.Tensor) else f"a {type(token_bytes).__name__}")
            raise ValueError(f"{pt_path} should hold a 1-D int tensor, got {got}; retrain: "
                             f"{TRAIN_HINT}")
        token_bytes = token_bytes.to(torch.int32)
    else:
        raise FileNotFoundError(f"no {TOKEN_BYTES_FILENAME} in {tokenizer_dir}; train a tokenizer "
                                f"first: {TRAIN_HINT}")
    return token_bytes.to(device)


# -----------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nanochat.tokenizer",
                                     description="Tokenizer utilities")
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert",
                                  help="turn nanochat's tokenizer.pkl into tokenizer.json",
                                  description="Write tokenizer.json and token_bytes.npy next to "
                                              "nanochat's tokenizer.pkl; the pickle is read "
                                              "without running anything in it.")
    convert.add_argument("tokenizer_dir", metavar="DIR",
                         help="directory holding tokenizer.pkl, e.g. ~/.cache/nanochat/tokenizer")
    convert.add_argument("--force", action="store_true",
                         help="replace a tokenizer.json that holds another tokenizer")
    export = commands.add_parser("export-hf",
                                 help="write our tokenizer as a Hugging Face tokenizer.json",
                                 description="Write DIR/tokenizer.json in the Hugging Face "
                                             "tokenizers format (it encodes as ours does) and "
                                             "DIR/tokenizer_config.json for transformers. Never "
                                             "replaces a tokenizer of ours.")
    export.add_argument("out_dir", metavar="DIR",
                        help="directory to write into (created if needed); not SRC")
    export.add_argument("--tokenizer-dir", metavar="SRC", default=None,
                        help="our tokenizer's directory (default: <base_dir>/tokenizer)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m nanochat.tokenizer convert DIR`: write tokenizer.json and token_bytes.npy next to
    nanochat's tokenizer.pkl in DIR. The pickle is read without running it and left as it is.
    `python -m nanochat.tokenizer export-hf DIR [--tokenizer-dir SRC]`: write our tokenizer (from
    SRC, default <base_dir>/tokenizer) as a Hugging Face tokenizer.json, plus
    tokenizer_config.json, into DIR."""
    args = _parser().parse_args(argv)
    if args.command == "export-hf":
        return _export_hf_command(args.out_dir, args.tokenizer_dir)
    print(f"command={args.command} tokenizer_dir={args.tokenizer_dir} force={args.force}")
    pkl_path = os.path.join(args.tokenizer_dir, PICKLE_FILENAME)
    if not os.path.exists(pkl_path):
        raise FileNotFoundError(f"{pkl_path} does not exist; convert reads the tokenizer.pkl that "
                                "upstream nanochat's scripts/tok_train.py writes")
    tokenizer = RustBPETokenizer._from_pickle(pkl_path)
    json_path = os.path.join(args.tokenizer_dir, TOKENIZER_FILENAME)
    if os.path.exists(json_path) and not args.force:
        existing = RustBPETokenizer._from_json(json_path)
        # the same tables: converting again is a no-op, not an error
        if (existing.mergeable_ranks, existing.special_tokens, existing.pattern) == (
                tokenizer.mergeable_ranks, tokenizer.special_tokens, tokenizer.pattern):
            print(f"{json_path} already holds the tokenizer of {pkl_path}; nothing to do")
            return 0
        raise FileExistsError(f"{json_path} exists and holds another tokenizer (vocab size "
                              f"{existing.get_vocab_size():,}, the pickle's is "
                              f"{tokenizer.get_vocab_size():,}); pass --force to replace it with "
                              "the pickle's")
    tokenizer.save(args.tokenizer_dir)
    print(f"read {pkl_path}: vocab size {tokenizer.get_vocab_size():,}, bos id "
          f"{tokenizer.get_bos_token_id()}")
    for filename in (TOKENIZER_FILENAME, TOKEN_BYTES_FILENAME):
        print(f"wrote {os.path.join(args.tokenizer_dir, filename)}")
    return 0


def _export_hf_command(out_dir: str, tokenizer_dir: str | None) -> int:
    out_dir = os.path.expanduser(out_dir)
    tokenizer_dir = (get_tokenizer_dir() if tokenizer_dir is None
                     else os.path.expanduser(tokenizer_dir))
    print(f"command=export-hf out_dir={out_dir} tokenizer_dir={tokenizer_dir}")
    # samefile, not a path comparison: "dir", "./dir" and a symlink to it are one directory
    if (os.path.isdir(out_dir) and os.path.isdir(tokenizer_dir)
            and os.path.samefile(out_dir, tokenizer_dir)):
        raise ValueError(f"DIR {out_dir} is the tokenizer's own directory; a Hugging Face "
                         "tokenizer.json there would replace ours: export into another directory")
    tokenizer = RustBPETokenizer.from_directory(tokenizer_dir)
    paths = tokenizer.export_hf(out_dir)
    print(f"read {tokenizer_dir}: vocab size {tokenizer.get_vocab_size():,}, bos "
          f"{tokenizer.bos_token} (id {tokenizer.get_bos_token_id()})")
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # FileNotFoundError is an OSError: one line, no traceback
    run(main, "the tokenizer command stopped; it writes each file whole or not at all: rerun the "
              "same command", (ValueError, OSError), error_status=1)


"""
Tests for nanochat/tokenizer.py and the scripts tok_train / tok_eval.

Covers encoding, our JSON format, upstream nanochat's API (the tiktoken-Encoding constructor, chat
rendering and its masks, decode_single_token_bytes, the calls nanochat's tok_train.py makes), and
loading nanochat's tokenizer.pkl and the convert CLI. Hostile and damaged pickles are refused by
the reader in tests/data/tokenizing/test_pickle_reader.py, which uses the pickle helpers here.
A throwaway tokenizer (vocab 512) is trained in-process on generated text; nothing here reads the
user's cache or the network (tiktoken's named encodings are replaced by local stand-ins).
Run: python -m pytest tests/test_tokenizer.py -q   (about ten seconds)
"""

import copy
import json
import logging
import os
import pickle
import random
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import tiktoken
from hypothesis import given, settings, strategies as st

from conftest import REPO_ROOT, write_shards
from nanochat.tokenizer import (MIN_VOCAB_SIZE, SPECIAL_TOKENS, SPLIT_PATTERN, RustBPETokenizer,
                                get_token_bytes, get_tokenizer)

VOCAB_SIZE = 512

TEXTS = [
    "",
    "hello world",
    "Hello, World! It's 3.14159 o'clock; we'll see.",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nwindows\nnewlines\n\n\n",
    "Ünïcödé façade naïve café",
    "你好，世界。日本語のテキスト。한국어 문장.",
    "Привет, мир! Γειά σου κόσμε.",
    "مرحبا بالعالم שלום עולם",  # right-to-left scripts
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷",  # multi-codepoint emoji
    "e\u0301 combining accent, zero\u200bwidth space",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|bos|> special-token text is plain text <|assistant_end|>",
    "1234567890 12345 007 3.000.000",
]


def make_docs(n: int, seed: int) -> list[str]:
    """Deterministic pseudo-text with words, numbers, punctuation and some non-ASCII."""
    rng = random.Random(seed)
    syllables = ["ka", "to", "ri", "mo", "en", "the", "ing", "ed", "qu", "an", "é", "ü", "好", "мир",
                 "σ"]
    docs = []
    for _ in range(n):
        words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(3, 15))]
        words.insert(rng.randint(0, len(words)), str(rng.randint(0, 10 ** 6)))
        docs.append(" ".join(words) + rng.choice([".", "!", "?", ",\n"]))
    return docs


@pytest.fixture(scope="module")
def tok():
    return RustBPETokenizer.train_from_iterator(iter(make_docs(3000, seed=0)), VOCAB_SIZE)


@pytest.fixture(scope="module")
def saved_dir(tok, tmp_path_factory):
    tokenizer_dir = str(tmp_path_factory.mktemp("saved") / "tokenizer")
    tok.save(tokenizer_dir)
    return tokenizer_dir


# -----------------------------------------------------------------------------
# Encoding and decoding


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.get_bos_token_id() for i in ids)  # no specials
    assert tok.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_round_trip_any_text(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_vocab_and_special_ids(tok):
    assert tok.get_vocab_size() == VOCAB_SIZE  # the training text is rich enough for every merge
    # a set of names, as tiktoken's special_tokens_set
    assert tok.get_special_tokens() == set(SPECIAL_TOKENS)
    # the specials come right after the mergeable ranks, <|bos|> first
    assert tok.get_bos_token_id() == len(tok.mergeable_ranks) == VOCAB_SIZE - len(SPECIAL_TOKENS)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.encode_special(name) == VOCAB_SIZE - len(SPECIAL_TOKENS) + i
        assert tok.id_to_token(tok.encode_special(name)) == name
    assert sorted(tok.mergeable_ranks.values()) == list(range(len(tok.mergeable_ranks)))
    assert tok.pattern == SPLIT_PATTERN


def test_prepend_and_append(tok):
    ids = tok.encode("hello world")
    bos = tok.get_bos_token_id()
    end = tok.encode_special("<|assistant_end|>")
    assert tok.encode("hello world", prepend="<|bos|>") == [bos] + ids
    assert tok.encode("hello world", prepend=bos) == [bos] + ids
    assert tok.encode("hello world", append="<|assistant_end|>") == ids + [end]
    assert tok.encode("hello world", prepend=bos, append=end) == [bos] + ids + [end]
    assert tok.encode("", prepend="<|bos|>") == [bos]
    assert tok.encode(["a", "b"], prepend="<|bos|>", append=end) == [
        [bos] + tok.encode("a") + [end], [bos] + tok.encode("b") + [end]]


def test_batch_equals_single(tok):
    docs = TEXTS + make_docs(50, seed=1)
    expected = [tok.encode(d, prepend="<|bos|>") for d in docs]
    assert tok.encode(docs, prepend="<|bos|>", num_threads=2) == expected
    assert tok.encode(docs, prepend="<|bos|>", num_threads=1) == expected
    assert tok.encode([]) == []


def test_numbers_split_into_at_most_two_digits(tok):
    digit_tokens = [t for t in tok.mergeable_ranks if t.isdigit()]
    assert any(len(t) == 2 for t in digit_tokens)  # guard: some number merges were learned
    assert all(len(t) <= 2 for t in digit_tokens)
    for text in ["12345", "x 1234567890 y", "0000000", "3.14159265"]:
        pieces = [tok.enc.decode_single_token_bytes(i) for i in tok.encode(text)]
        assert b"".join(pieces) == text.encode()
        assert all(sum(c in b"0123456789" for c in p) <= 2 for p in pieces), pieces
    assert len(tok.encode("12345")) >= 3


def test_bad_encode_arguments(tok):
    with pytest.raises(ValueError, match="not a special token"):
        tok.encode("hi", prepend="<|nope|>")
    with pytest.raises(ValueError, match="the vocab's ids"):
        tok.encode("hi", append=VOCAB_SIZE)
    with pytest.raises(TypeError, match="prepend"):
        tok.encode("hi", prepend=1.5)
    with pytest.raises(TypeError, match="str or a list of str"):
        tok.encode(b"bytes")
    with pytest.raises(TypeError, match="non-str"):
        tok.encode(["ok", 3])
    with pytest.raises(ValueError, match="special tokens are"):
        tok.encode_special("hello")


# -----------------------------------------------------------------------------
# Saving and loading


def test_save_load_round_trip(tok, saved_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("loading a tokenizer must never unpickle")
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    loaded = RustBPETokenizer.from_directory(saved_dir)
    docs = TEXTS + make_docs(100, seed=2)
    assert loaded.encode(docs, prepend="<|bos|>") == tok.encode(docs, prepend="<|bos|>")
    assert loaded.get_vocab_size() == tok.get_vocab_size()
    assert loaded.get_special_tokens() == tok.get_special_tokens()
    assert loaded.get_bos_token_id() == tok.get_bos_token_id()
    assert loaded.mergeable_ranks == tok.mergeable_ranks


def test_saved_file_is_json(saved_dir):
    # no leftover temp files
    assert sorted(os.listdir(saved_dir)) == ["token_bytes.npy", "tokenizer.json"]
    with open(os.path.join(saved_dir, "tokenizer.json"), "rb") as f:
        raw = f.read()
    assert not raw.startswith(b"\x80")  # pickle protocol 2+ opens with 0x80
    data = json.loads(raw.decode("utf-8"))
    assert data["format"] == "nanochat-tokenizer" and data["version"] == 1
    assert data["bos_token"] == "<|bos|>"
    assert list(data["special_tokens"]) == SPECIAL_TOKENS
    assert len(data["mergeable_ranks"]) == VOCAB_SIZE - len(SPECIAL_TOKENS)
    assert data["mergeable_ranks"][:2] == [["AA==", 0], ["AQ==", 1]]  # base64 of bytes 0x00, 0x01


def test_save_is_atomic(tok, tmp_path, monkeypatch):
    def failing_replace(src, dst):
        raise OSError("disk full (simulated)")

    # a fresh directory: nothing lands under the final names, no temp files stay behind
    fresh = tmp_path / "fresh"
    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        tok.save(str(fresh))
    assert os.listdir(fresh) == []

    # an existing tokenizer stays exactly as it was
    monkeypatch.undo()
    old = tmp_path / "old"
    small = RustBPETokenizer.train_from_iterator(iter(make_docs(200, seed=3)), 300)
    small.save(str(old))
    before = {name: (old / name).read_bytes() for name in os.listdir(old)}
    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError):
        tok.save(str(old))
    assert {name: (old / name).read_bytes() for name in os.listdir(old)} == before


def test_token_bytes(tok, saved_dir):
    token_bytes = tok.compute_token_bytes()
    assert token_bytes.shape == (VOCAB_SIZE,) and token_bytes.dtype == np.int32
    bos = tok.get_bos_token_id()
    assert (token_bytes[bos:] == 0).all()  # specials
    assert (token_bytes[:256] == 1).all() and (token_bytes[256:bos] >= 2).all()
    for text in TEXTS + make_docs(20, seed=4):
        assert token_bytes[tok.encode(text)].sum() == len(text.encode("utf-8"))

    loaded = get_token_bytes(tokenizer_dir=saved_dir)
    assert str(loaded.dtype) == "torch.int32" and loaded.device.type == "cpu"
    assert (loaded.numpy() == token_bytes).all()
    # no object arrays inside
    np.load(os.path.join(saved_dir, "token_bytes.npy"), allow_pickle=False)


def test_get_tokenizer_reads_base_dir(tok, tmp_path):
    base_dir = os.environ["NANOCHAT_BASE_DIR"]  # set by conftest to a tmp dir
    with pytest.raises(FileNotFoundError, match="scripts.tok_train"):
        get_tokenizer()
    tok.save(os.path.join(base_dir, "tokenizer"))
    assert get_tokenizer().encode(TEXTS) == tok.encode(TEXTS)
    assert (get_token_bytes("cpu").numpy() == tok.compute_token_bytes()).all()


def test_from_pretrained_uses_endoftext_as_bos(monkeypatch):
    # a local stand-in for tiktoken's "gpt2" (the real one is downloaded): bytes + <|endoftext|>
    ranks = {bytes([b]): b for b in range(256)}
    fake = tiktoken.Encoding("fake-gpt2", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 256})
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: fake)
    pretrained = RustBPETokenizer.from_pretrained("gpt2")
    assert pretrained.get_bos_token_id() == 256
    assert pretrained.get_vocab_size() == 257
    assert pretrained.encode("hi", prepend=pretrained.get_bos_token_id()) == [256, 104, 105]

    bare = tiktoken.Encoding("bare", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks,
                             special_tokens={})
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: bare)
    with pytest.raises(ValueError, match="endoftext"):
        RustBPETokenizer.from_pretrained("bare")


def test_constructor_takes_a_tiktoken_encoding(tok, tmp_path):
    # nanochat builds the class as RustBPETokenizer(enc, bos_token)
    enc = tiktoken.Encoding("mine", pat_str=tok.pattern, mergeable_ranks=tok.mergeable_ranks,
                            special_tokens=tok.special_tokens)
    built = RustBPETokenizer(enc, "<|bos|>")
    assert built.enc is enc and isinstance(tok.enc, tiktoken.Encoding)
    assert (built.bos_token_id == built.get_bos_token_id() == tok.get_bos_token_id()
            == VOCAB_SIZE - 9)
    assert built.encode(TEXTS, prepend="<|bos|>") == tok.encode(TEXTS, prepend="<|bos|>")
    built.save(str(tmp_path / "built"))  # and it saves as JSON like a trained one
    assert (RustBPETokenizer.from_directory(str(tmp_path / "built")).encode(TEXTS)
            == tok.encode(TEXTS))
    with pytest.raises(TypeError, match="tiktoken.Encoding"):
        RustBPETokenizer({"<|bos|>": 0}, "<|bos|>")
    with pytest.raises(ValueError, match=r"bos_token '<\|nope\|>'"):
        RustBPETokenizer(enc, "<|nope|>")


def test_decode_single_token_bytes(tok):
    # rustbpe gives byte b the rank b, so ids 0..255 are the single bytes
    assert all(tok.mergeable_ranks[bytes([b])] == b for b in range(256))
    assert tok.decode_single_token_bytes(97) == b"a"
    merged, rank = next((t, r) for t, r in tok.mergeable_ranks.items() if len(t) >= 2)
    assert tok.decode_single_token_bytes(rank) == merged
    # a lone byte >= 0x80 is not UTF-8: the text view loses it, the bytes view keeps it
    assert tok.decode_single_token_bytes(0xE4) == b"\xe4"
    assert tok.id_to_token(0xE4) == "\ufffd" and len(tok.id_to_token(0xE4).encode()) == 3
    assert tok.decode_single_token_bytes(tok.get_bos_token_id()) == b"<|bos|>"


# -----------------------------------------------------------------------------
# Chat conversations


def _pieces(*pieces) -> tuple[list[int], list[int]]:
    """(ids, mask) from (ids, mask value) pieces, in order: the expected output, written by hand."""
    return [i for ids, _ in pieces for i in ids], [m for ids, m in pieces for _ in ids]


def test_render_conversation(tok):
    s, e = tok.encode_special, tok.encode
    conversation = {"messages": [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello!"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]}
    expected = _pieces(
        ([tok.get_bos_token_id()], 0),
        ([s("<|user_start|>")], 0), (e("hi there"), 0), ([s("<|user_end|>")], 0),
        ([s("<|assistant_start|>")], 0), (e("hello!"), 1), ([s("<|assistant_end|>")], 1),
        ([s("<|user_start|>")], 0), (e("2+2?"), 0), ([s("<|user_end|>")], 0),
        ([s("<|assistant_start|>")], 0), (e("4"), 1), ([s("<|assistant_end|>")], 1),
    )
    assert tok.render_conversation(conversation) == expected
    ids, mask = expected
    # <|bos|>, <|user_start|>, ... <|assistant_end|>
    assert ids[:2] == [503, 504] and ids[-1] == 507
    assert sum(mask) == len(e("hello!")) + len(e("4")) + 2


def test_render_conversation_merges_a_system_message(tok):
    s, e = tok.encode_special, tok.encode
    conversation = {"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]}
    before = copy.deepcopy(conversation)
    expected = _pieces(
        ([tok.get_bos_token_id(), s("<|user_start|>")], 0), (e("be brief\n\nhi"), 0),
        ([s("<|user_end|>"), s("<|assistant_start|>")], 0), (e("yo"), 1),
        ([s("<|assistant_end|>")], 1),
    )
    assert tok.render_conversation(conversation) == expected
    assert conversation == before  # the caller's messages are not changed


def test_render_conversation_tool_parts(tok):
    s, e = tok.encode_special, tok.encode
    conversation = {"messages": [
        {"role": "user", "content": "what is 2+2?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "let me check"},
            {"type": "python", "text": "2+2"},
            {"type": "python_output", "text": "4"},
            {"type": "text", "text": "it is 4"},
        ]},
    ]}
    expected = _pieces(
        ([tok.get_bos_token_id(), s("<|user_start|>")], 0), (e("what is 2+2?"), 0),
        ([s("<|user_end|>"), s("<|assistant_start|>")], 0),
        (e("let me check"), 1),
        # the model writes the call
        ([s("<|python_start|>")] + e("2+2") + [s("<|python_end|>")], 1),
        # the interpreter writes the output
        ([s("<|output_start|>")] + e("4") + [s("<|output_end|>")], 0),
        (e("it is 4"), 1),
        ([s("<|assistant_end|>")], 1),
    )
    assert tok.render_conversation(conversation) == expected


def test_render_conversation_truncates(tok):
    conversation = {"messages": [{"role": "user", "content": "hello " * 100},
                                 {"role": "assistant", "content": "world " * 1000}]}
    ids, mask = tok.render_conversation(conversation, max_tokens=10**6)
    assert len(ids) > 2048
    assert tok.render_conversation(conversation, max_tokens=7) == (ids[:7], mask[:7])
    assert tok.render_conversation(conversation) == (ids[:2048], mask[:2048])  # the default


@pytest.mark.parametrize("messages, error", [
    ([], "no messages"),
    ([{"role": "assistant", "content": "hi"}],
     "message 0 .* from 'assistant' but should be from 'user'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "should be from 'assistant'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "assistant", "content": "c"}], "message 2 .* should be from 'user'"),
    ([{"role": "system", "content": "s"}], "followed by a user message"),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
     "followed by a user message"),
    ([{"role": "user", "content": ["not", "a", "str"]}], "user's content must be a str"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": 42}],
     "str or a list of parts"),
    ([{"role": "user", "content": "q"},
      {"role": "assistant", "content": [{"type": "image", "text": "x"}]}],
     "unknown part type 'image'"),
])
def test_render_conversation_rejects_bad_conversations(tok, messages, error):
    with pytest.raises(ValueError, match=error):
        tok.render_conversation({"messages": messages})


def test_render_for_completion(tok):
    s, e = tok.encode_special, tok.encode
    conversation = {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "the reference answer"},
    ]}
    before = copy.deepcopy(conversation)
    expected = ([tok.get_bos_token_id(), s("<|user_start|>")] + e("hi") + [s("<|user_end|>")]
                + [s("<|assistant_start|>")] + e("hello") + [s("<|assistant_end|>")]
                + [s("<|user_start|>")] + e("2+2?") + [s("<|user_end|>")]
                + [s("<|assistant_start|>")])
    assert tok.render_for_completion(conversation) == expected
    assert conversation == before
    with pytest.raises(ValueError, match="last message must be the assistant's"):
        tok.render_for_completion({"messages": conversation["messages"][:3]})
    with pytest.raises(ValueError, match="last message must be the assistant's"):
        tok.render_for_completion({"messages": []})


def test_visualize_tokenization(tok):
    bos = tok.get_bos_token_id()
    assert tok.decode([97]) == "a"
    assert tok.visualize_tokenization([97, bos], [1, 0]) == (
        "\033[92ma\033[0m|\033[91m<|bos|>\033[0m")
    assert tok.visualize_tokenization([97, bos], [1, 0], with_token_id=True) == (
        "\033[92ma\033[0m|\033[90m(97)\033[0m|\033[91m<|bos|>\033[0m|\033[90m(503)\033[0m")


# -----------------------------------------------------------------------------
# Upstream nanochat's tokenizer.pkl, read without running it


def write_nanochat_dir(tok, path, protocol: int = pickle.DEFAULT_PROTOCOL) -> str:
    """A tokenizer directory as upstream nanochat writes it: its tiktoken Encoding pickled, and
    token_bytes.pt."""
    import torch
    os.makedirs(path)
    enc = tiktoken.Encoding("rustbpe", pat_str=tok.pattern, mergeable_ranks=tok.mergeable_ranks,
                            special_tokens=tok.special_tokens)
    with open(os.path.join(path, "tokenizer.pkl"), "wb") as f:
        pickle.dump(enc, f, protocol=protocol)
    torch.save(torch.from_numpy(tok.compute_token_bytes()), os.path.join(path, "token_bytes.pt"))
    return str(path)


def refuse_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("loading a tokenizer must never call pickle.load")
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


@pytest.mark.parametrize("protocol", range(3, pickle.HIGHEST_PROTOCOL + 1))
def test_nanochat_pickle_loads(tok, tmp_path, monkeypatch, protocol):
    nanochat_dir = write_nanochat_dir(tok, tmp_path / "nanochat", protocol)
    files = sorted(os.listdir(nanochat_dir))
    refuse_unpickling(monkeypatch)
    loaded = RustBPETokenizer.from_directory(nanochat_dir)
    monkeypatch.undo()
    docs = TEXTS + make_docs(100, seed=21)
    assert loaded.encode(docs, prepend="<|bos|>") == tok.encode(docs, prepend="<|bos|>")
    assert loaded.get_special_tokens() == set(SPECIAL_TOKENS)
    assert loaded.get_bos_token_id() == tok.get_bos_token_id()
    assert loaded.mergeable_ranks == tok.mergeable_ranks
    # only token_bytes.pt is there, and it is read too
    assert (get_token_bytes(tokenizer_dir=nanochat_dir).numpy() == tok.compute_token_bytes()).all()
    assert sorted(os.listdir(nanochat_dir)) == files  # loading wrote nothing


class Call:
    """Pickles as a call: pickle.loads of it runs func(*args)."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def pickled_encoding(state) -> bytes:
    """tiktoken's Encoding with any state, laid out as pickle.dump lays out an Encoding: the class,
    NEWOBJ (an empty instance), the state, then BUILD (which hands the state to __setstate__)."""
    state_opcodes = pickle.dumps(state, protocol=2)[2:-1]  # without its PROTO header and STOP
    return b"\x80\x02ctiktoken.core\nEncoding\n)\x81" + state_opcodes + b"b."


def hostile_pickles(marker: str) -> dict:
    """name -> (pickle bytes that create the file marker when unpickled, the global it asks for)."""
    hidden = {"name": Call(os.system, f"touch {marker}"), "pat_str": SPLIT_PATTERN,
              "mergeable_ranks": {}, "special_tokens": {}}
    return {
        "os.system": (pickle.dumps(Call(os.system, f"touch {marker}")), "posix.system"),
        "builtins.exec": (pickle.dumps(Call(exec, f"open({marker!r}, 'w').close()")),
                          "builtins.exec"),
        "builtins.open": (pickle.dumps(Call(open, marker, "w")), "builtins.open"),
        "a call hidden in an Encoding's state": (pickled_encoding(hidden), "posix.system"),
    }


def test_json_wins_over_pickle(tok, tmp_path, caplog):
    other = RustBPETokenizer.train_from_iterator(iter(make_docs(200, seed=22)), 300)
    both = write_nanochat_dir(other, tmp_path / "both")
    tok.save(both)
    json_path, pkl_path = os.path.join(both, "tokenizer.json"), os.path.join(both, "tokenizer.pkl")
    os.utime(pkl_path, (1_000_000, 1_000_000))  # the pickle is older: quietly use tokenizer.json
    with caplog.at_level(logging.WARNING, logger="nanochat.tokenizer"):
        assert RustBPETokenizer.from_directory(both).get_vocab_size() == VOCAB_SIZE
    assert not caplog.records
    # newer: still tokenizer.json, with a warning
    os.utime(pkl_path, (os.path.getmtime(json_path) + 60,) * 2)
    with caplog.at_level(logging.WARNING, logger="nanochat.tokenizer"):
        assert RustBPETokenizer.from_directory(both).get_vocab_size() == VOCAB_SIZE
    assert "newer" in caplog.text and f"python -m nanochat.tokenizer convert {both}" in caplog.text


def _convert(tokenizer_dir: str, base_dir: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NANOCHAT_BASE_DIR=base_dir)
    return subprocess.run([sys.executable, "-m", "nanochat.tokenizer", "convert", tokenizer_dir],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_convert_cli(tok, tmp_path):
    nanochat_dir = write_nanochat_dir(tok, tmp_path / "nanochat")
    pkl_path = os.path.join(nanochat_dir, "tokenizer.pkl")
    pkl_before = (open(pkl_path, "rb").read(), os.path.getmtime(pkl_path))
    result = _convert(nanochat_dir, str(tmp_path / "base"))
    assert result.returncode == 0, result.stderr
    assert f"wrote {os.path.join(nanochat_dir, 'tokenizer.json')}" in result.stdout
    assert f"wrote {os.path.join(nanochat_dir, 'token_bytes.npy')}" in result.stdout
    assert sorted(os.listdir(nanochat_dir)) == ["token_bytes.npy", "token_bytes.pt",
                                                "tokenizer.json", "tokenizer.pkl"]
    # untouched
    assert (open(pkl_path, "rb").read(), os.path.getmtime(pkl_path)) == pkl_before

    # load the converted files alone, so the pickle cannot be read
    json_only = tmp_path / "json_only"
    json_only.mkdir()
    for name in ("tokenizer.json", "token_bytes.npy"):
        shutil.copy(os.path.join(nanochat_dir, name), json_only / name)
    converted = RustBPETokenizer.from_directory(str(json_only))
    docs = TEXTS + make_docs(100, seed=23)
    assert converted.encode(docs, prepend="<|bos|>") == tok.encode(docs, prepend="<|bos|>")
    assert (get_token_bytes(tokenizer_dir=str(json_only)).numpy()
            == tok.compute_token_bytes()).all()


@pytest.mark.slow
def test_convert_keeps_a_different_tokenizer_json(tok, tmp_path):
    # tokenizer.json is the user's: convert replaces it only when told to, and says nothing needs
    # doing when it already holds the pickle's tokenizer
    other = RustBPETokenizer.train_from_iterator(iter(make_docs(200, seed=22)), 300)
    both = write_nanochat_dir(tok, tmp_path / "both")
    other.save(both)
    before = open(os.path.join(both, "tokenizer.json"), "rb").read()
    refused = _convert(both, str(tmp_path / "base"))
    assert (refused.returncode == 1 and "holds another tokenizer" in refused.stderr
            and "--force" in refused.stderr)
    assert open(os.path.join(both, "tokenizer.json"), "rb").read() == before
    forced = subprocess.run([sys.executable, "-m", "nanochat.tokenizer", "convert", both,
                             "--force"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert forced.returncode == 0, forced.stderr
    assert RustBPETokenizer.from_directory(both).get_vocab_size() == tok.get_vocab_size()
    again = _convert(both, str(tmp_path / "base"))
    assert again.returncode == 0 and "nothing to do" in again.stdout


def test_pickled_tables_with_far_apart_ids_or_deep_nesting_are_refused(tok, tmp_path):
    ranks = dict(tok.mergeable_ranks)
    states = {
        "huge id": {"name": "x", "pat_str": tok.pattern, "mergeable_ranks": ranks,
                    "special_tokens": {"<|bos|>": 50_000_000}},  # a 200 MB token_bytes.npy
        "id past u32": {"name": "x", "pat_str": tok.pattern, "mergeable_ranks": ranks,
                        "special_tokens": {"<|bos|>": 2**32}},
        "deeply nested": {"name": "x", "pat_str": tok.pattern,
                          "mergeable_ranks": {**ranks, b"zz": 987654321},
                          "special_tokens": {"<|bos|>": len(ranks)}},
    }
    # unpickling nests without recursion: 100,000 lists inside each other in place of the rank
    # 987654321
    nested = b"]" * 100_000 + b"a" * 99_999
    for name, state in states.items():
        bad_dir = tmp_path / name.replace(" ", "_")
        bad_dir.mkdir()
        payload = pickled_encoding(state).replace(b"J" + struct.pack("<i", 987654321), nested)
        assert (nested in payload) == (name == "deeply nested")
        (bad_dir / "tokenizer.pkl").write_bytes(payload)
        with pytest.raises(ValueError) as info:
            RustBPETokenizer.from_directory(str(bad_dir))
        assert str(bad_dir / "tokenizer.pkl") in str(info.value), name


def test_token_bytes_pt_is_checked(tmp_path):
    import torch
    for name, value in {"a list": [1, 2, 3], "floats": torch.ones(4),
                        "2-D": torch.ones(2, 2, dtype=torch.int32)}.items():
        torch.save(value, tmp_path / "token_bytes.pt")
        with pytest.raises(ValueError, match="token_bytes.pt should hold a 1-D int tensor"):
            get_token_bytes(tokenizer_dir=str(tmp_path))
    (tmp_path / "token_bytes.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="token_bytes.pt is not a valid token bytes file") as info:
        get_token_bytes(tokenizer_dir=str(tmp_path))
    assert "weights_only=False" not in str(info.value)  # never advise loading it unsafely
    torch.save(torch.tensor([0, 1, 2], dtype=torch.int64), tmp_path / "token_bytes.pt")
    assert get_token_bytes(tokenizer_dir=str(tmp_path)).tolist() == [0, 1, 2]


def test_encode_special_of_ordinary_text_is_its_single_token(tok):
    # as nanochat's (tiktoken's encode_single_token): any text that is exactly one token has an id
    assert tok.encode_special("a") == tok.encode("a")[0]
    assert tok.encode_special("<|bos|>") == tok.get_bos_token_id()
    with pytest.raises(ValueError, match="not a special token"):
        tok.encode_special("certainly not one token")


def test_convert_cli_reports_bad_input(tmp_path):
    missing = _convert(str(tmp_path / "nope"), str(tmp_path / "base"))
    assert missing.returncode == 1 and "tokenizer.pkl does not exist" in missing.stderr
    marker = str(tmp_path / "created_by_the_pickle")
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (hostile / "tokenizer.pkl").write_bytes(hostile_pickles(marker)["os.system"][0])
    refused = _convert(str(hostile), str(tmp_path / "base"))
    assert refused.returncode == 1 and "refused without running anything" in refused.stderr
    assert not os.path.exists(marker) and os.listdir(hostile) == ["tokenizer.pkl"]


# -----------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("vocab_size", [0, 256, MIN_VOCAB_SIZE - 1])
def test_vocab_size_too_small(vocab_size):
    with pytest.raises(ValueError, match=rf"vocab_size must be an integer >= {MIN_VOCAB_SIZE}"
                                         rf".*got {vocab_size}"):
        RustBPETokenizer.train_from_iterator(iter(["some text"]), vocab_size)
    assert MIN_VOCAB_SIZE == 265


def test_vocab_size_wrong_type():
    with pytest.raises(TypeError, match="vocab_size"):
        RustBPETokenizer.train_from_iterator(iter(["some text"]), 512.0)


def test_smallest_vocab_trains():
    small = RustBPETokenizer.train_from_iterator(iter(make_docs(50, seed=5)), MIN_VOCAB_SIZE)
    assert small.get_vocab_size() == MIN_VOCAB_SIZE and small.get_bos_token_id() == 256


def test_missing_tokenizer(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="python -m scripts.tok_train") as info:
        RustBPETokenizer.from_directory(str(missing))
    assert str(missing) in str(info.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="python -m scripts.tok_train") as info:
        RustBPETokenizer.from_directory(str(empty))
    assert str(empty / "tokenizer.json") in str(info.value)
    with pytest.raises(FileNotFoundError, match="token_bytes.npy"):
        get_token_bytes(tokenizer_dir=str(empty))


def _corruptions(data: dict) -> dict:
    """name -> bytes of a damaged tokenizer.json."""
    raw = json.dumps(data).encode()
    no_byte = dict(data, mergeable_ranks=data["mergeable_ranks"][1:])
    bad_b64 = dict(data, mergeable_ranks=[["not base64!", 0]] + data["mergeable_ranks"][1:])
    clash = dict(data, special_tokens=dict(data["special_tokens"], **{"<|bos|>": 0}))
    return {
        "truncated": raw[:len(raw) // 2],
        "empty": b"",
        "not utf-8": b"\xff\xfe" + raw,
        "a list": b"[]",
        "wrong format": json.dumps(dict(data, format="other")).encode(),
        "future version": json.dumps(dict(data, version=99)).encode(),
        "missing key": json.dumps({k: v for k, v in data.items() if k != "pattern"}).encode(),
        "missing byte": json.dumps(no_byte).encode(),
        "bad base64": json.dumps(bad_b64).encode(),
        "special clashes": json.dumps(clash).encode(),
        "bad pattern": json.dumps(dict(data, pattern="(")).encode(),
        "unknown bos": json.dumps(dict(data, bos_token="<|nope|>")).encode(),
    }


def test_corrupt_tokenizer_json(saved_dir, tmp_path):
    with open(os.path.join(saved_dir, "tokenizer.json")) as f:
        data = json.load(f)
    for name, raw in _corruptions(data).items():
        bad_dir = tmp_path / name.replace(" ", "_")
        bad_dir.mkdir()
        path = bad_dir / "tokenizer.json"
        path.write_bytes(raw)
        with pytest.raises(ValueError, match="is not a valid tokenizer file") as info:
            RustBPETokenizer.from_directory(str(bad_dir))
        assert str(path) in str(info.value), name


def test_corrupt_token_bytes(tmp_path):
    (tmp_path / "token_bytes.npy").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="token_bytes.npy"):
        get_token_bytes(tokenizer_dir=str(tmp_path))


def test_import_has_no_side_effects(tmp_path):
    base_dir = tmp_path / "never_created"
    code = ("import logging, sys, nanochat.tokenizer; "
            "assert not logging.getLogger().handlers; "
            "assert 'torch' not in sys.modules and 'rustbpe' not in sys.modules")
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base_dir))
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, check=True)
    assert not base_dir.exists()


# -----------------------------------------------------------------------------
# Scripts


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_scripts_end_to_end(tmp_path):
    data_dir = str(tmp_path / "shards")
    write_shards(data_dir, [make_docs(400, seed=10), make_docs(400, seed=11),
                            make_docs(200, seed=12)], 100)

    train = _run(["scripts.tok_train", "--vocab-size", "300", "--max-chars", "30000",
                  "--data-dir", data_dir])
    assert train.returncode == 0, train.stderr
    assert "vocab_size: 300" in train.stdout  # echoed args
    assert "trained on 30,000 characters" in train.stdout
    assert "vocab size: 300 (bos id 291)" in train.stdout
    # the default --out-dir
    tokenizer_dir = os.path.join(os.environ["NANOCHAT_BASE_DIR"], "tokenizer")
    assert sorted(os.listdir(tokenizer_dir)) == ["token_bytes.npy", "tokenizer.json"]
    assert get_tokenizer().get_vocab_size() == 300

    evaluate = _run(["scripts.tok_eval", "--data-dir", data_dir, "--max-docs", "150",
                     "--compare", "none"])
    assert evaluate.returncode == 0, evaluate.stderr
    rows = [line.split() for line in evaluate.stdout.splitlines()
            if line.startswith(("train ", "val "))]
    assert [row[:2] for row in rows] == [["train", "ours"], ["val", "ours"]]
    for row in rows:
        assert row[3] == "150"  # docs
        assert 1.5 < float(row[6]) < 10  # bytes per token: merges happened, yet tokens stay short


def test_tok_train_crops_documents(tmp_path, capsys):
    from scripts import tok_train
    data_dir = str(tmp_path / "shards")
    write_shards(data_dir, [make_docs(100, seed=13), make_docs(20, seed=14)], 30)
    out_dir = str(tmp_path / "tok")
    # every generated doc is over 10 chars, so 1000 chars at 10 per doc are exactly 100 docs
    tok_train.main(["--vocab-size", "280", "--max-chars", "1000", "--doc-cap", "10",
                    "--data-dir", data_dir, "--out-dir", out_dir])
    assert "trained on 1,000 characters from 100 documents" in capsys.readouterr().out
    assert RustBPETokenizer.from_directory(out_dir).get_vocab_size() <= 280


@pytest.mark.parametrize("max_chars, row_groups", [(10**9, 6), (1000, 1)])
def test_tok_train_bar_counts_the_text_there(tmp_path, capsys, max_chars, row_groups):
    """The bar ends full, at the row groups read: all of them when the shards hold less than
    --max-chars (its default is 2B characters), fewer when --max-chars ends the run first."""
    from scripts import tok_train
    data_dir = str(tmp_path / "shards")
    write_shards(data_dir, [make_docs(100, seed=13), make_docs(50, seed=14),
                            make_docs(20, seed=15)], 30)
    tok_train.main(["--vocab-size", "280", "--max-chars", str(max_chars), "--data-dir", data_dir,
                    "--out-dir", str(tmp_path / "tok")])
    # stderr is not a terminal here: the bar is plain lines, the last one full
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("reading:")]
    assert "\r" not in err
    assert lines[0].startswith("reading:   0%| 0/") and len(lines) <= 6  # start, quarters, end
    # 4 + 2 row groups of train; val is not read
    assert lines[-1].startswith(f"reading: 100%| {row_groups}/{row_groups} [")


@pytest.mark.slow
def test_scripts_report_bad_input(tmp_path):
    too_small = _run(["scripts.tok_train", "--vocab-size", "100", "--data-dir", str(tmp_path)])
    assert too_small.returncode == 2 and "--vocab-size must be >= 265" in too_small.stderr
    no_data = _run(["scripts.tok_train", "--vocab-size", "300",
                    "--data-dir", str(tmp_path / "nope")])
    assert no_data.returncode == 1 and "python -m nanochat.dataset" in no_data.stderr
    no_tok = _run(["scripts.tok_eval", "--tokenizer-dir", str(tmp_path / "nope"),
                   "--compare", "none"])
    assert no_tok.returncode == 1 and "python -m scripts.tok_train" in no_tok.stderr


def test_tok_eval_skips_unavailable_references(tok, saved_dir, tmp_path, monkeypatch, capsys):
    from scripts import tok_eval
    data_dir = str(tmp_path / "shards")
    write_shards(data_dir, [make_docs(50, seed=15), make_docs(50, seed=16)], 25)

    def offline(name):
        raise ConnectionError(f"cannot download {name} (simulated offline)")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    tok_eval.main(["--tokenizer-dir", saved_dir, "--data-dir", data_dir, "--max-docs", "40"])
    out = capsys.readouterr().out
    assert "skipping gpt2" in out and "skipping cl100k_base" in out
    assert "train  ours" in out and "val    ours" in out


def test_encode_to_arrays_matches_encode(tok):
    texts = ["hello world 12345", "", "ünïcode <|bos|> text", "a\nb\n\nc"]
    bos = tok.get_bos_token_id()
    arrays = tok.encode_to_arrays(texts, prepend=bos, num_threads=2)
    assert all(a.dtype == np.uint16 for a in arrays)  # the vocab fits 2 bytes
    assert [a.tolist() for a in arrays] == tok.encode(texts, prepend=bos)
    assert [a.tolist() for a in tok.encode_to_arrays(texts)] == tok.encode(texts)
    with pytest.raises(TypeError):
        tok.encode_to_arrays("not a list")

"""
Tests for nanochat/data/tokenizing/pickle_reader.py: nanochat's tokenizer.pkl read without running
it. Hostile pickles (a call to os.system, exec or open, also hidden in an Encoding's state) are
refused before anything runs; pickles of other things and damaged pickles are ValueErrors naming
the file and the fix. Through RustBPETokenizer.from_directory, as a user meets them, and directly.
Run: python -m pytest tests/data/tokenizing/test_pickle_reader.py -q   (a few seconds)
"""

import datetime
import os
import pickle

import pytest
import tiktoken

from nanochat.data.tokenizing.pickle_reader import UnsafePickleError, read_pickled_encoding
from nanochat.tokenizer import SPLIT_PATTERN, RustBPETokenizer
from test_tokenizer import (VOCAB_SIZE, hostile_pickles, make_docs, pickled_encoding,
                            refuse_unpickling, write_nanochat_dir)


@pytest.fixture(scope="module")
def tok():
    return RustBPETokenizer.train_from_iterator(iter(make_docs(3000, seed=0)), VOCAB_SIZE)


def testhostile_pickles_are_refused(tmp_path, monkeypatch):
    marker = str(tmp_path / "created_by_the_pickle")
    for name, (payload, global_name) in hostile_pickles(marker).items():
        # the payload is live: real unpickling creates the file
        try:
            pickle.loads(payload)
        except (TypeError, ValueError):
            pass  # the Encoding with a bad state fails, but only after the call in it has run
        assert os.path.exists(marker), name
        os.remove(marker)

        bad_dir = tmp_path / name.replace(" ", "_")
        bad_dir.mkdir()
        (bad_dir / "tokenizer.pkl").write_bytes(payload)
        refuse_unpickling(monkeypatch)
        with pytest.raises(UnsafePickleError, match="refused without running anything") as info:
            RustBPETokenizer.from_directory(str(bad_dir))
        monkeypatch.undo()
        assert isinstance(info.value, ValueError)
        assert (str(bad_dir / "tokenizer.pkl") in str(info.value)
                and global_name in str(info.value)), name
        assert not os.path.exists(marker), name


def test_pickles_of_other_things_are_refused(tmp_path, monkeypatch):
    def write(name: str, payload: bytes) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.pkl").write_bytes(payload)
        return str(tmp_path / name)

    other_class = write("other_class", pickle.dumps(datetime.date(2024, 1, 1)))
    with pytest.raises(UnsafePickleError, match="datetime.date") as info:
        RustBPETokenizer.from_directory(other_class)
    assert other_class in str(info.value)

    plain_dict = write("plain_dict", pickle.dumps({"name": "rustbpe"}))
    with pytest.raises(ValueError, match="holds a dict, not a pickled tiktoken Encoding"):
        RustBPETokenizer.from_directory(plain_dict)

    # tiktoken pickles its registered encodings by name; loading one would mean a download
    monkeypatch.setattr(tiktoken, "get_encoding",
                        lambda name: pytest.fail("must not fetch an encoding"))
    by_name = write("by_name", pickled_encoding("gpt2"))
    with pytest.raises(ValueError, match=r"from_pretrained\('gpt2'\)"):
        RustBPETokenizer.from_directory(by_name)

    bad_tables = write("bad_tables", pickled_encoding(
        {"name": "rustbpe", "pat_str": SPLIT_PATTERN, "mergeable_ranks": {"a": 0},
         "special_tokens": {}}))
    with pytest.raises(ValueError, match="unusable tables") as info:
        RustBPETokenizer.from_directory(bad_tables)
    assert bad_tables in str(info.value)


def test_damaged_pickles(tok, tmp_path):
    good = open(os.path.join(write_nanochat_dir(tok, tmp_path / "good"), "tokenizer.pkl"),
                "rb").read()
    for name, payload in {"truncated": good[:len(good) // 2], "empty": b"",
                          "not a pickle": b"tokenizer tables\n",
                          "cut after the header": good[:12]}.items():
        bad_dir = tmp_path / name.replace(" ", "_")
        bad_dir.mkdir()
        (bad_dir / "tokenizer.pkl").write_bytes(payload)
        with pytest.raises(ValueError, match="is not a valid pickled tokenizer") as info:
            RustBPETokenizer.from_directory(str(bad_dir))
        assert (str(bad_dir / "tokenizer.pkl") in str(info.value)
                and "scripts.tok_train" in str(info.value)), name


def test_the_reader_returns_the_pickled_tables_and_runs_nothing(tok, tmp_path, monkeypatch):
    path = os.path.join(write_nanochat_dir(tok, tmp_path / "nanochat"), "tokenizer.pkl")
    refuse_unpickling(monkeypatch)
    state = read_pickled_encoding(path)
    monkeypatch.undo()
    assert state == {"name": "rustbpe", "pat_str": tok.pattern,
                     "mergeable_ranks": tok.mergeable_ranks, "special_tokens": tok.special_tokens}
    marker = str(tmp_path / "created_by_the_pickle")
    (tmp_path / "hostile.pkl").write_bytes(hostile_pickles(marker)["builtins.exec"][0])
    with pytest.raises(UnsafePickleError, match="builtins.exec"):
        read_pickled_encoding(str(tmp_path / "hostile.pkl"))
    assert not os.path.exists(marker)

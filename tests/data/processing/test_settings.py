"""
pretokenize.json (nanochat/data/processing/settings.py): the settings a run records (the
tokenizer by its file's hash, the dtype its vocabulary needs, the windows, the convention), their
refusal of a run with other settings (checked in every directory before any is written), a
damaged file named in its error, and a bucket of another tokenizer refused. Hermetic. Run:
    python -m pytest tests/data/processing/test_settings.py -q
"""

import hashlib
import json
import os

import pytest

from nanochat.data.processing.settings import (check_or_write_settings, check_other_buckets,
                                                 read_settings, run_settings)


class Vocab:
    """What run_settings asks of a tokenizer."""

    def __init__(self, size: int, bos: int):
        self.size, self.bos = size, bos

    def get_vocab_size(self):
        return self.size

    def get_bos_token_id(self):
        return self.bos


@pytest.fixture
def tokenizer_file(tmp_path):
    path = tmp_path / "tokenizer.pkl"
    path.write_bytes(b"some tokenizer")
    return str(path)


def test_run_settings(tokenizer_file):
    settings = run_settings(Vocab(300, 7), tokenizer_file, 32, 4)
    assert settings == {"format": "GPTS", "version": 1, "dtype": "uint16", "vocab_size": 300,
                        "bos_token_id": 7,
                        "tokenizer_sha256": hashlib.sha256(b"some tokenizer").hexdigest(),
                        "max_length": 32, "overlap_size": 4, "convention": "nanochat",
                        "eod_token_id": None}
    # no windows: no overlap recorded; more than 2**16 ids: 4 bytes a token; gpt-simple's EOD is
    # the BOS id
    wide = run_settings(Vocab(2**16 + 1, 7), tokenizer_file, None, 4, "gpt-simple")
    assert (wide["overlap_size"], wide["dtype"], wide["eod_token_id"]) == (0, "uint32", 7)


def test_other_settings_are_refused_before_anything_is_written(tmp_path, tokenizer_file):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    settings = run_settings(Vocab(300, 7), tokenizer_file, 32, 4)
    check_or_write_settings([one], settings, "a new --output directory")
    assert read_settings(os.path.join(one, "pretokenize.json")) == settings
    check_or_write_settings([one], settings, "a new --output directory")  # the same: accepted
    other = dict(settings, max_length=24)
    with pytest.raises(ValueError, match=r"one/pretokenize.json records other settings than this "
                                         r"run's \(max_length 32 -> 24\); the shards there would "
                                         r"mix, so use a new --output directory or the same"):
        check_or_write_settings([two, one], other, "a new --output directory")
    assert not os.path.exists(two)  # the refusal left nothing half-recorded


def test_a_damaged_settings_file_is_named(tmp_path):
    path = tmp_path / "pretokenize.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"{path} \\(pretokenize's settings\\) is not valid JSON"):
        read_settings(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not pretokenize's settings"):
        read_settings(str(path))
    path.write_text(json.dumps({"max_length": None}))  # written before conventions
    assert read_settings(str(path)) == {"convention": "nanochat", "max_length": None}


def test_a_bucket_of_another_tokenizer_is_refused(tmp_path, tokenizer_file):
    out = str(tmp_path / "out")
    web = run_settings(Vocab(300, 7), tokenizer_file, 32, 4)
    check_or_write_settings([os.path.join(out, "train", "web")], web, "another --bucket name")
    # other windows are fine: each bucket keeps its own
    check_other_buckets(out, "code", run_settings(Vocab(300, 7), tokenizer_file, None, 0))
    check_other_buckets(out, "web", run_settings(Vocab(400, 7), tokenizer_file, 32, 4))  # itself
    with pytest.raises(ValueError, match=r"web/pretokenize.json records another tokenizer than "
                                         r"this run's \(vocab_size 300 -> 400\)"):
        check_other_buckets(out, "code", run_settings(Vocab(400, 7), tokenizer_file, 32, 4))


def test_two_runs_planning_at_once_with_other_settings_one_is_refused(tmp_path, monkeypatch):
    from nanochat.data.processing import settings as module

    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_bytes(b"t")
    ours = run_settings(Vocab(300, 256), str(tokenizer), None, 0)
    theirs = run_settings(Vocab(300, 256), str(tokenizer), 64, 8)
    real_link = os.link

    def other_run_writes_first(src, dst):  # after our check found no file, before our write
        with open(dst, "w") as f:
            json.dump(theirs, f)
        real_link(src, dst)

    monkeypatch.setattr(module.os, "link", other_run_writes_first)
    with pytest.raises(ValueError, match=r"records other settings than this run's \(max_length "
                                         r"64 -> None, overlap_size 8 -> 0\)"):
        check_or_write_settings([str(tmp_path)], ours, "elsewhere")
    assert read_settings(str(tmp_path / "pretokenize.json"))["max_length"] == 64
    assert sorted(os.listdir(tmp_path)) == ["pretokenize.json", "tokenizer.json"]  # no tmp left

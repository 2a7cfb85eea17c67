"""
Paths and kinds of data directories (nanochat/data/base/layout.py and every public entry
point that takes a directory):
- every data_dir= (parquet loaders, pretokenized loader, mixture loader, validate, the dataset
  listing and downloader, merge_states) and every CLI path (--input, --val-input, --output, --data,
  --data-dir, the curriculum file) accepts a pathlib.Path and a path starting with "~" (HOME points
  at tmp_path), and gives what the plain string gives;
- a directory holding another kind of data than the caller reads or writes is an error that says
  what it holds and what to pass instead, never one that suggests writing into it.
Hermetic: tiny parquet shards, jsonl files and a 300-token tokenizer trained in-process, all under
tmp_path.
Run: python -m pytest tests/data/base/test_layout.py -q
"""

import functools
import http.server
import json
import logging
import os
import pathlib
import re
import threading

import numpy as np
import pytest
import torch

from conftest import ByteTokenizer, sample_texts, write_shards
from nanochat.data.mixtures.curriculum import load_curriculum, validate
from nanochat.dataloader import (
    pretokenized_distributed_data_loader_with_state_bos_bestfit as PRETOKENIZED,
    tokenizing_distributed_data_loader_with_state as CONCAT,
    tokenizing_distributed_data_loader_with_state_bos_bestfit as PARQUET,
)
from nanochat.data.base.datasets import list_parquet_files, split_parquet_files
from nanochat.dataset import (download_shards, download_single_file, main as dataset_main,
                              parquets_iter_batched)
from nanochat.data.base.layout import data_kind, describe_mismatch
from nanochat.mixture import (main as mixture_main,
                              pretokenized_mixture_loader_with_state_bos_bestfit as MIX)
from nanochat.data.mixtures.mixture_state import merge_mixture_states
from nanochat.pretokenize import main as pretokenize
from nanochat.resume import merge_states
from nanochat.data.pretokenized.token_shards import write_token_shard
from nanochat.tokenizer import RustBPETokenizer

WORDS = "the loader reads shards of tokens from a directory given as a path 12 é".split()
TEXTS = dict(words=WORDS, lengths=range(1, 31))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """root/parquet (2 train shards + val), root/tokenizer, root/tokens (a plain pretokenize
    output), root/DATA (buckets web, from the parquet shards, and code, from jsonl),
    root/cur.yaml."""
    root = tmp_path_factory.mktemp("layout")
    write_shards(root / "parquet", [sample_texts(seed, 40, **TEXTS) for seed in range(3)],
                 row_group_size=8)
    RustBPETokenizer.train_from_iterator(iter(sample_texts(0, 60, **TEXTS)), 300).save(
        str(root / "tokenizer"))
    common = ["--tokenizer-dir", str(root / "tokenizer"), "--num-workers", "1"]
    assert pretokenize(["--input", str(root / "parquet"), "--output", str(root / "tokens"),
                        *common]) == 0
    assert pretokenize(["--input", str(root / "parquet"), "--output", str(root / "DATA"),
                        "--bucket", "web", *common]) == 0
    for split, seed in (("train", 7), ("val", 8)):
        with open(root / f"code_{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in sample_texts(seed, 40, **TEXTS))
    assert pretokenize(["--input", str(root / "code_train.jsonl"),
                        "--val-input", str(root / "code_val.jsonl"),
                        "--output", str(root / "DATA"), "--bucket", "code", *common]) == 0
    (root / "cur.yaml").write_text("curriculum:\n  - tokens: 256\n"
                                   "    mix: {web: 0.5, code: 0.5}\n")
    return root


FORMS = ["Path", "tilde"]


def _as(form: str, path) -> str | pathlib.Path:
    """path as a pathlib.Path, or as "~/..." (HOME is the module's root: see the home fixture)."""
    if form == "Path":
        return pathlib.Path(path)
    return "~/" + os.path.relpath(path, os.environ["HOME"])


@pytest.fixture
def home(root, monkeypatch):
    monkeypatch.setenv("HOME", str(root))
    return root


def _first_batch(loader) -> list:
    out = [t.clone() if isinstance(t, torch.Tensor) else t for t in next(loader)]
    loader.close()
    return out


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


# -----------------------------------------------------------------------------
# ~ and pathlib.Path


@pytest.mark.parametrize("form", FORMS)
def test_dataset_listing(home, form):
    parquet = str(home / "parquet")
    assert list_parquet_files(_as(form, parquet)) == list_parquet_files(parquet) != []
    for split in ("train", "val"):
        assert split_parquet_files(split, _as(form, parquet)) == split_parquet_files(split, parquet)
    assert list(parquets_iter_batched("val", data_dir=_as(form, parquet))) == \
        list(parquets_iter_batched("val", data_dir=parquet))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("loader", [PARQUET, CONCAT])
def test_parquet_loaders(home, form, loader):
    kw = dict(device="cpu", rank=0, world_size=1, prefetch=0)
    _same(_first_batch(loader(ByteTokenizer(), 2, 16, "train", data_dir=_as(form, home / "parquet"),
                              **kw)),
          _first_batch(loader(ByteTokenizer(), 2, 16, "train", data_dir=str(home / "parquet"),
                              **kw)))


@pytest.mark.parametrize("form", FORMS)
def test_pretokenized_loader_and_merge_states(home, form):
    kw = dict(device="cpu", world_size=2, chunk_size=4, batch_size=4, buffer_size=8, prefetch=0)
    tokens = str(home / "tokens")
    batches = [_first_batch(PRETOKENIZED(2, 16, "train", data_dir=_as(form, home / "tokens"),
                                         rank=r, **kw))
               for r in range(2)]
    for r in range(2):
        _same(batches[r],
              _first_batch(PRETOKENIZED(2, 16, "train", data_dir=tokens, rank=r, **kw)))
    states = [batch[2] for batch in batches]
    assert (merge_states(states, 1, data_dir=_as(form, tokens))
            == merge_states(states, 1, data_dir=tokens))


@pytest.mark.parametrize("form", FORMS)
def test_mixture_loader_validate_and_merge_states(home, form, caplog):
    data, cur = str(home / "DATA"), str(home / "cur.yaml")
    kw = dict(device="cpu", world_size=2, chunk_size=4, batch_size=4, buffer_size=8, prefetch=0)
    caplog.set_level(logging.WARNING)
    batches = [_first_batch(MIX(2, 16, "train", _as(form, cur), data_dir=_as(form, data), rank=r,
                                **kw))
               for r in range(2)]
    # each bucket's pretokenize.json was found
    assert "no vocabulary size" not in caplog.text
    for r in range(2):
        _same(batches[r], _first_batch(MIX(2, 16, "train", cur, data_dir=data, rank=r, **kw)))
    states = [batch[2] for batch in batches]
    merged = merge_states(states, 3, data_dir=data)
    assert merge_states(states, 3, data_dir=_as(form, data)) == merged
    assert merge_mixture_states(states, 3, data_dir=_as(form, data)) == merged
    assert validate(_as(form, cur), _as(form, data), T=16) == validate(cur, data, T=16)
    assert load_curriculum(_as(form, cur)) == load_curriculum(cur)


@pytest.fixture(scope="module")
def server(root):
    """The parquet directory served over HTTP on 127.0.0.1 (index i is shard_0000i.parquet)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler,
                                directory=str(root / "parquet"))
    handler.log_message = lambda *args: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("form", FORMS)
def test_downloads(home, server, form):
    target = home / f"download_{form}"
    assert download_shards([0, 2], data_dir=_as(form, target), base_url=server, check_disk=False,
                           progress=False) == []
    assert download_single_file(1, data_dir=_as(form, target), base_url=server,
                                progress=False)
    for i in range(3):
        name = f"shard_{i:05d}.parquet"
        assert (target / name).read_bytes() == (home / "parquet" / name).read_bytes()
    assert not os.path.exists("~")  # nothing went to a directory literally named "~"


def test_clis_expand_tilde(home, capsys):
    common = ["--tokenizer-dir", "~/tokenizer", "--num-workers", "1"]
    assert pretokenize(["--input", "~/parquet", "--output", "~/cli_tokens", *common]) == 0
    assert pretokenize(["--input", "~/code_train.jsonl", "--val-input", "~/code_val.jsonl",
                        "--output", "~/cli_data", "--bucket", "code", *common]) == 0
    for split in ("train", "val"):
        assert (sorted(os.listdir(home / "cli_tokens" / split))
                == sorted(os.listdir(home / "tokens" / split)) != [])
        names = os.listdir(home / "DATA" / split / "code")
        assert names, f"no {split} shards of bucket code to compare"
        for name in names:
            assert (home / "cli_data" / split / "code" / name).read_bytes() == \
                (home / "DATA" / split / "code" / name).read_bytes()
    capsys.readouterr()
    assert mixture_main(["validate", "~/cur.yaml", "--data", "~/DATA"]) == 0
    assert "blocking problems: none" in capsys.readouterr().out
    assert dataset_main(["--verify", "--data-dir", "~/parquet"]) == 0
    assert f"checked 3 shards in {home / 'parquet'}: 3 good, 0 bad" in capsys.readouterr().out
    assert not os.path.exists("~")


# -----------------------------------------------------------------------------
# The wrong kind of directory: what it holds, and what to pass instead


def test_data_kind(root, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not data")
    assert {name: data_kind(str(path)) for name, path in [
        ("parquet", root / "parquet"), ("tokens", root / "tokens"), ("DATA", root / "DATA"),
        ("split", root / "tokens" / "train"), ("bucket", root / "DATA" / "val" / "code"),
        ("empty", tmp_path / "empty"), ("other", tmp_path / "other"),
        ("missing", tmp_path / "missing")]} == {
        "parquet": "parquet", "tokens": "pretokenized", "DATA": "buckets", "split": "pairs",
        "bucket": "pairs", "empty": "empty", "other": "empty", "missing": "missing"}
    with pytest.raises(ValueError, match="wanted must be one of"):
        describe_mismatch(str(root), "tokens")


def _no_write_into(message: str, directory) -> str:
    """The message, checked not to suggest --output into directory (a new directory beside it is
    fine) after its first clause, which names what was passed."""
    advice = message.removeprefix("error: ").split(": ", 1)[1]
    assert not re.search(r"--output " + re.escape(str(directory)) + r"(\s|$|;|,)", advice), message
    return message


PLAIN = "a pretokenize output (.bin/.idx pairs in train/ and val/)"
BUCKETS = "mixture buckets (.bin/.idx pairs in train/<bucket>/ and val/<bucket>/)"
LOADER = "nanochat.dataloader.pretokenized_distributed_data_loader_with_state_bos_bestfit"
MIXER = "nanochat.mixture.pretokenized_mixture_loader_with_state_bos_bestfit"


def test_pretokenized_loader_given_other_data(root, tmp_path):
    parquet, data, tokens = root / "parquet", root / "DATA", root / "tokens"

    def error(directory) -> str:
        with pytest.raises(ValueError) as info:
            PRETOKENIZED(2, 16, "train", device="cpu", data_dir=str(directory))
        return _no_write_into(str(info.value), directory)

    assert error(parquet) == (f"{parquet} holds parquet shards, not {PLAIN}: pretokenize them into "
                              f"a new directory: python -m nanochat.pretokenize --input {parquet} "
                              f"--output {parquet}_tokens, then pass {parquet}_tokens")
    assert error(data) == (f"{data} holds {BUCKETS}, not {PLAIN}: read them with {MIXER} (a "
                           "curriculum of one bucket reads that bucket alone)")
    assert error(tokens / "train") == f"{tokens / 'train'} is the train/ directory of the " \
                                      f"pretokenize output {tokens}: pass {tokens}"
    assert error(data / "train" / "web") == (
        f"{data / 'train' / 'web'} is the directory of bucket 'web' in the mixture data {data}: "
        f"{data} holds {BUCKETS}, not {PLAIN}: read them with {MIXER} (a curriculum of one bucket "
        "reads that bucket alone)")
    # pairs in a directory of their own (GPT-Simple's tokenize writes them so): where the loaders
    # look for them
    (tmp_path / "flat").mkdir()
    write_token_shard(str(tmp_path / "flat" / "part_0"), [np.array([1, 2, 3])], [0], np.uint16)
    assert error(tmp_path / "flat") == (
        f"{tmp_path / 'flat'} holds .bin/.idx pairs itself, but the loaders read them from "
        "DIR/train/ and DIR/val/ (a pretokenize output) or DIR/train/<bucket>/ (mixture buckets): "
        "pass such a directory DIR")


def test_parquet_readers_given_token_shards(root):
    tokens, data = root / "tokens", root / "DATA"
    with pytest.raises(ValueError) as info:
        PARQUET(ByteTokenizer(), 2, 16, "train", device="cpu", data_dir=str(tokens))
    assert _no_write_into(str(info.value), tokens) == (
        f"{tokens} holds {PLAIN}, not parquet shards: read it with {LOADER}, or pass the "
        "directory of the parquet shards")
    for call in (lambda: list_parquet_files(str(data)),
                 lambda: next(parquets_iter_batched("train", data_dir=data))):
        with pytest.raises(ValueError) as info:
            call()
        assert _no_write_into(str(info.value), data) == (
            f"{data} holds {BUCKETS}, not parquet shards: read them with {MIXER}, or pass the "
            "directory of the parquet shards")
    # a dataset directory with nothing in it yet lists nothing (the downloader fills it)
    os.makedirs(root / "fresh", exist_ok=True)
    assert list_parquet_files(str(root / "fresh")) == []


def test_mixture_given_other_data(root, capsys):
    tokens, data, parquet, cur = (root / "tokens", root / "DATA", root / "parquet",
                                  str(root / "cur.yaml"))
    with pytest.raises(ValueError) as info:
        MIX(2, 16, "train", cur, data_dir=str(tokens), device="cpu")
    assert _no_write_into(str(info.value), tokens) == (
        f"{tokens} holds {PLAIN}, not {BUCKETS}: read it with {LOADER}; for a mixture, pretokenize "
        f"each bucket into a new directory (python -m nanochat.pretokenize --input ... --output "
        f"{tokens}_buckets --bucket NAME) and pass that")
    with pytest.raises(ValueError) as info:
        validate(cur, str(data / "val" / "code"))
    assert str(info.value) == f"{data / 'val' / 'code'} is the directory of bucket 'code' in the " \
                              f"mixture data {data}: pass {data}"
    assert mixture_main(["validate", cur, "--data", str(parquet)]) == 2
    assert _no_write_into(capsys.readouterr().err, parquet) == (
        f"error: {parquet} holds parquet shards, not {BUCKETS}: pretokenize them into a new "
        f"directory: python -m nanochat.pretokenize --input {parquet} --output {parquet}_tokens "
        f"--bucket NAME, then pass {parquet}_tokens\n")
    # nothing there at all: the command that writes a bucket there
    with pytest.raises(FileNotFoundError,
                       match=re.escape(f"--output {root / 'nowhere'} --bucket NAME")):
        validate(cur, str(root / "nowhere"))


def _files(directory) -> dict:
    return {os.path.join(r, n): os.stat(os.path.join(r, n)).st_mtime_ns
            for r, _, names in os.walk(directory) for n in names}


def test_pretokenize_refuses_an_output_of_another_kind(root, monkeypatch):
    parquet, data, tokens = root / "parquet", root / "DATA", root / "tokens"
    before = _files(root)

    def error(*args) -> str:
        with pytest.raises(ValueError) as info:
            pretokenize(["--input", str(parquet), "--tokenizer-dir", str(root / "tokenizer"),
                         "--num-workers", "1", *args])
        return str(info.value)

    assert _no_write_into(error("--output", str(parquet)), parquet) == (
        f"--output {parquet} holds parquet shards, not {PLAIN}: pretokenized shards go to a "
        f"directory of their own, e.g. --output {parquet}_tokens")
    assert error("--output", str(data / "train" / "web")) == (
        f"--output {data / 'train' / 'web'} is the directory of bucket 'web' in the mixture data "
        f"{data}: pass --output {data} --bucket web")
    # a new bucket's directory
    assert error("--output", str(data / "train" / "math"), "--bucket", "math") == (
        f"--output {data / 'train' / 'math'} is the directory of bucket 'math' in the mixture data "
        f"{data}: pass --output {data} --bucket math")
    assert error("--output", str(data)) == (
        f"--output {data} holds {BUCKETS}, not {PLAIN}: add --bucket NAME to write one more bucket "
        "there, or pass a new --output directory")
    assert _no_write_into(error("--output", str(tokens), "--bucket", "web"), tokens) == (
        f"--output {tokens} holds {PLAIN}, not {BUCKETS}: buckets go to a directory of their own, "
        f"e.g. --output {tokens}_buckets --bucket NAME")
    assert error("--output", str(tokens / "val")) == (
        f"--output {tokens / 'val'} is the val/ directory of the pretokenize output {tokens}: "
        f"pass --output {tokens}")
    assert _files(root) == before  # nothing written anywhere, no directory made
    # relative paths stay relative in the message
    monkeypatch.chdir(root)
    assert error("--output", os.path.join("DATA", "val", "code")) == (
        f"--output {os.path.join('DATA', 'val', 'code')} is the directory of bucket 'code' in the "
        "mixture data DATA: pass --output DATA --bucket code")


def test_readme_pretokenized_snippets_with_tilde(tmp_path, monkeypatch):
    """The README's pretokenize command and loader call, as written but for one worker process and
    the loader on the CPU with a short T, under a HOME of our own: no shell expands the "~" of
    either."""
    monkeypatch.setenv("HOME", str(tmp_path))
    write_shards(tmp_path / ".cache" / "nanochat" / "base_data_climbmix",
                 [sample_texts(seed, 30, **TEXTS) for seed in range(3)], row_group_size=8)
    RustBPETokenizer.train_from_iterator(iter(sample_texts(0, 60, **TEXTS)), 300).save(
        os.environ["NANOCHAT_BASE_DIR"] + "/tokenizer")
    assert pretokenize(["--input", "~/.cache/nanochat/base_data_climbmix",
                        "--output", "~/.cache/nanochat/base_tokens",
                        "--max-length", "2049", "--overlap-size", "256", "--num-workers", "1"]) == 0
    kw = dict(B=2, T=64, split="train", device="cpu", attention_info=True, max_docs_per_row=64)
    got = _first_batch(PRETOKENIZED(data_dir="~/.cache/nanochat/base_tokens", **kw))
    _same(got[:3], _first_batch(PRETOKENIZED(data_dir=str(tmp_path / ".cache/nanochat/base_tokens"),
                                             **kw))[:3])
    assert got[0].shape == (2, 64) and set(got[3]) >= {"doc_ids", "position_ids", "cu_seqlens"}

"""
Messages a new user meets, each saying what is true and what to do:
- a shard file passed as a data directory is called a file, and the directory it is in is named;
- `--verify` on shards the downloader did not fetch never suggests downloading into them;
- an empty or missing data directory names `repackage` beside the download;
- a model's state dict passed as resume_state_dict is called not a loader state;
- a missing tokenizer or missing shards, where none was passed, name NANOCHAT_BASE_DIR (and
  NANOCHAT_DATA_DIR) and how to set it;
- every command's --help says what it does, in sentences that end.

Run: python -m pytest tests/test_messages.py -q
"""

import importlib
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO_ROOT, write_shards
from nanochat.data.mixtures.curriculum import list_buckets
from nanochat.dataloader import (pretokenized_distributed_data_loader_with_state_bos_bestfit,
                                 tokenizing_distributed_data_loader_with_state_bos_bestfit)
from nanochat.data.base.datasets import list_parquet_files, split_parquet_files
from nanochat.dataset import main as dataset_main
from nanochat.data.mixtures.mixture_state import mixture_start
from nanochat.resume import merge_states
from nanochat.data.pretokenized.token_reader import shard_paths
from nanochat.data.pretokenized.token_shards import write_token_shard
from nanochat.tokenizer import RustBPETokenizer, get_tokenizer

REPACKAGE = "python -m nanochat.dataset repackage INPUTS --out"


def _dataset_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanochat.dataset", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


def _docs(n: int, seed: int) -> list[str]:
    return [f"document {seed}-{i}: " + "word " * (i % 7 + 1) for i in range(n)]


# -----------------------------------------------------------------------------
# A file passed as a data directory


def test_a_shard_passed_as_data_dir_is_called_a_file(tmp_path, byte_tokenizer):
    paths = write_shards(str(tmp_path / "shards"), [_docs(10, 0), _docs(5, 1)], 5)
    fix = (f"{paths[0]} is a file, not a directory: data_dir must be the directory that holds "
           f"parquet shards; pass {tmp_path / 'shards'}, the directory it is in")
    for call in (lambda: list_parquet_files(paths[0]),
                 lambda: split_parquet_files("train", paths[0]),
                 lambda: next(tokenizing_distributed_data_loader_with_state_bos_bestfit(
                     byte_tokenizer, 2, 8, "train", device="cpu", data_dir=paths[0]))):
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == fix


def test_a_token_shard_passed_as_data_dir_names_the_whole_output(tmp_path):
    train = tmp_path / "tokens" / "train"
    train.mkdir(parents=True)
    write_token_shard(str(train / "shard_000"), [np.array([1, 2, 3])], [0], np.uint16)
    with pytest.raises(ValueError) as info:
        shard_paths(str(train / "shard_000.bin"), "train")
    assert str(info.value) == (
        f"{train / 'shard_000.bin'} is a file, not a directory: data_dir must be the directory "
        "that holds a pretokenize output (.bin/.idx pairs in train/ and val/); pass "
        f"{tmp_path / 'tokens'}, which holds {train}, the directory it is in")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        next(pretokenized_distributed_data_loader_with_state_bos_bestfit(
            2, 8, "train", device="cpu", data_dir=str(train / "shard_000.bin")))


def test_a_file_passed_for_mixture_buckets_is_called_a_file(tmp_path):
    bucket = tmp_path / "mix" / "train" / "web"
    bucket.mkdir(parents=True)
    write_token_shard(str(bucket / "shard_000"), [np.array([1, 2, 3])], [0], np.uint16)
    with pytest.raises(ValueError) as info:
        list_buckets(str(bucket / "shard_000.idx"), "train")
    assert str(info.value).startswith(f"{bucket / 'shard_000.idx'} is a file, not a directory: "
                                      "data_dir must be the directory that holds mixture buckets")
    assert str(info.value).endswith(f"; pass {tmp_path / 'mix'}, which holds {bucket}, the "
                                    "directory it is in")


def test_a_parquet_file_given_to_the_pretokenized_loader_says_where_it_is(tmp_path):
    paths = write_shards(str(tmp_path / "shards"), [_docs(10, 0), _docs(5, 1)], 5)
    with pytest.raises(ValueError) as info:
        shard_paths(paths[0], "train")
    assert str(info.value).endswith(f"; the file is in {tmp_path / 'shards'}")


@pytest.mark.slow
def test_a_file_on_the_cli_is_called_a_file(tmp_path):
    paths = write_shards(str(tmp_path / "shards"), [_docs(10, 0), _docs(5, 1)], 5)
    done = _dataset_cli("--verify", "--data-dir", paths[1])
    assert done.returncode == 2
    assert done.stderr == (f"error: {paths[1]} is a file, not a directory: data_dir must be the "
                           "directory that holds parquet shards; pass "
                           f"{tmp_path / 'shards'}, the directory it is in\n")
    assert "does not exist" not in done.stderr
    train = subprocess.run([sys.executable, "-m", "scripts.tok_train", "--vocab-size", "300",
                            "--data-dir", paths[0]], cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=60)
    assert train.returncode == 1
    assert train.stderr == (f"error: {paths[0]} is a file, not a directory: data_dir must be the "
                            "directory that holds parquet shards; pass "
                            f"{tmp_path / 'shards'}, the directory it is in\n")
    RustBPETokenizer.train_from_iterator(_docs(10, 0), 300).save(str(tmp_path / "tok"))
    evaluate = subprocess.run([sys.executable, "-m", "scripts.tok_eval", "--data-dir", paths[0],
                               "--tokenizer-dir", str(tmp_path / "tok"), "--compare", "none"],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert evaluate.returncode == 1 and "Traceback" not in evaluate.stderr, evaluate.stderr
    assert evaluate.stderr.endswith(f"error: {paths[0]} is a file, not a directory: data_dir must "
                                    "be the directory that holds parquet shards; pass "
                                    f"{tmp_path / 'shards'}, the directory it is in\n")


# -----------------------------------------------------------------------------
# --verify on your own shards


def test_verify_on_your_own_shards_never_suggests_a_download(tmp_path, capsys):
    # repackage names its shards like the dataset's (shard_00000.parquet, ...), with no records
    source = tmp_path / "mine.txt"
    source.write_text("".join(f"my own document {i}\n\n" for i in range(30)))
    data_dir = tmp_path / "mine"
    assert dataset_main(["repackage", str(source), "--out", str(data_dir),
                         "--docs-per-shard", "10"]) == 0
    capsys.readouterr()
    assert dataset_main(["--verify", "--data-dir", str(data_dir)]) == 0
    out = capsys.readouterr().out
    assert f"checked 3 shards in {data_dir}: 3 good, 0 bad\n" in out
    assert ("3 have no .json record (your own shards, or fetched by another tool): for them the "
            "parquet structure and every page were checked, not size and sha256\n") in out
    (data_dir / "shard_00001.parquet").write_bytes(b"PAR1 not a shard")
    assert dataset_main(["--verify", "--data-dir", str(data_dir)]) == 1
    out = capsys.readouterr().out
    assert f"checked 3 shards in {data_dir}: 2 good, 1 bad\n" in out
    assert "to fix" not in out and "-n " not in out and "--base-url" not in out
    assert ("not fetchable from climbmix-400b (named unlike its shards, or outside its "
            "directory with no .json record), so nothing here downloads them: "
            "shard_00001.parquet; write them again from their source files (python -m "
            "nanochat.dataset repackage INPUTS --out NEW_DIR, a directory without parquet files) "
            "or delete them\n") in out
    # the dataset's own directory, as nanochat's downloader leaves it (no .json records): a bad
    # shard of the dataset there is fetched again, not written again
    own = tmp_path / "base_data_climbmix"
    os.makedirs(own)
    shutil.copy(data_dir / "shard_00000.parquet", own / "shard_00000.parquet")
    shutil.copy(data_dir / "shard_00002.parquet", own / "shard_06542.parquet")  # its val
    (own / "shard_00001.parquet").write_bytes(b"PAR1 cut short")
    assert dataset_main(["--verify", "--data-dir", str(own)]) == 1
    out = capsys.readouterr().out
    assert (f"to fix: python -m nanochat.dataset --dataset climbmix-400b --data-dir {own} -n 2 "
            in out)
    assert "not fetchable" not in out and "repackage" not in out


# -----------------------------------------------------------------------------
# An empty or missing data directory


def test_no_shards_names_repackage_beside_the_download(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for data_dir, says in ((empty, f"no parquet shards in {empty}; "),
                           (tmp_path / "nope", f"data directory {tmp_path / 'nope'} does not "
                                               "exist; ")):
        with pytest.raises(FileNotFoundError) as info:
            split_parquet_files("train", str(data_dir))
        assert str(info.value) == (
            f"{says}download some: python -m nanochat.dataset -n 8, or write your own text files "
            f"(.txt, .jsonl, .jsonl.gz, .parquet) as shards: {REPACKAGE} {data_dir}")


def test_verify_of_an_empty_directory_names_repackage(tmp_path):
    done = _dataset_cli("--verify", "--data-dir", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: no parquet shards in {tmp_path}; download some: ")
    assert done.stderr.endswith(f"{REPACKAGE} {tmp_path}\n")


# -----------------------------------------------------------------------------
# Where the data lives: <base_dir>, NANOCHAT_BASE_DIR and NANOCHAT_DATA_DIR

BASE_DIR_FIX = "export NANOCHAT_BASE_DIR=DIR"


def test_the_readmes_usage_says_how_base_dir_is_set():
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    usage = readme[readme.index("## Using it from a training script"):]
    usage = usage[:usage.index("\n## ")]
    assert "get_tokenizer()" in usage and "<base_dir>" in usage
    for words in ("`<base_dir>` is `$NANOCHAT_BASE_DIR`, or `~/.cache/nanochat` when it is unset",
                  "`$NANOCHAT_DATA_DIR` when it is set"):
        assert words in " ".join(usage.split()), words


def test_a_missing_tokenizer_names_the_base_dir_variable(tmp_path, monkeypatch):
    base = os.environ["NANOCHAT_BASE_DIR"]  # (conftest's, under tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        get_tokenizer()
    assert str(info.value) == (
        f"tokenizer directory {base}/tokenizer does not exist; train a tokenizer first: "
        "python -m scripts.tok_train. It is <base_dir>/tokenizer, with <base_dir> from "
        f"NANOCHAT_BASE_DIR; a tokenizer trained under another base dir is found with "
        f"{BASE_DIR_FIX} (DIR holds tokenizer/)")
    os.makedirs(os.path.join(base, "tokenizer"))  # there, but empty: the same words
    with pytest.raises(FileNotFoundError) as info:
        get_tokenizer()
    assert "tokenizer.json does not exist" in str(info.value)
    assert str(info.value).endswith(f"{BASE_DIR_FIX} (DIR holds tokenizer/)")
    # unset: the default, said as such
    monkeypatch.delenv("NANOCHAT_BASE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(FileNotFoundError) as info:
        get_tokenizer()
    assert (f"{tmp_path / 'home'}/.cache/nanochat/tokenizer does not exist; " in str(info.value)
            and "with <base_dir> ~/.cache/nanochat, as NANOCHAT_BASE_DIR is unset; "
            in str(info.value) and BASE_DIR_FIX in str(info.value))
    # a directory passed by hand is the caller's: no word of the base dir
    with pytest.raises(FileNotFoundError) as info:
        RustBPETokenizer.from_directory(str(tmp_path / "mine"))
    assert "NANOCHAT_BASE_DIR" not in str(info.value)


def test_missing_shards_name_the_variables_where_none_was_passed(tmp_path, monkeypatch):
    base = os.environ["NANOCHAT_BASE_DIR"]
    found = (". Given no data_dir, the readers use <base_dir>/base_data_climbmix, with "
             "<base_dir> from NANOCHAT_BASE_DIR; to read shards elsewhere, pass data_dir "
             "(--data-dir), or export NANOCHAT_DATA_DIR=DIR (the shards' directory) or "
             "NANOCHAT_BASE_DIR=DIR (DIR holds base_data_climbmix/)")
    with pytest.raises(FileNotFoundError) as info:
        split_parquet_files("train")
    assert str(info.value).startswith(f"data directory {base}/base_data_climbmix does not exist; ")
    assert str(info.value).endswith(found)
    os.makedirs(os.path.join(base, "base_data_climbmix"))  # there, but empty
    with pytest.raises(FileNotFoundError) as info:
        split_parquet_files("val")
    assert str(info.value).startswith(f"no parquet shards in {base}/base_data_climbmix; ")
    assert str(info.value).endswith(found)
    # a script that looks the directory up itself says the same (tok_train, a real process)
    done = subprocess.run([sys.executable, "-m", "scripts.tok_train"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.strip().endswith(found), done.stderr
    # NANOCHAT_DATA_DIR, when it names the directory
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / "mine"))
    (tmp_path / "mine").mkdir()
    with pytest.raises(FileNotFoundError) as info:
        split_parquet_files("train")
    assert str(info.value).endswith(
        ". It is $NANOCHAT_DATA_DIR, which the readers use when given no data_dir: point it at "
        "the directory of your shards, or unset it")


# -----------------------------------------------------------------------------
# A state that is not a loader state


MODEL = {"transformer.wte.weight": torch.zeros(4, 2), "transformer.h.0.attn.c_q.weight":
         torch.zeros(2, 2), "lm_head.weight": torch.zeros(4, 2), "transformer.h.0.mlp.c_fc.weight":
         torch.zeros(2, 2)}
WHAT_IT_IS = ("A loader state is the third item the loader yields, (inputs, targets, state_dict): "
              "a dict of pq_idx, rg_idx, epoch, version, plan, ... (nanochat's own: pq_idx, "
              "rg_idx, epoch). Save that one with the checkpoint, e.g. as "
              "checkpoint['dataloader_state_dict'], and pass it back")


def _resume_error(tmp_path, tokenizer, state) -> str:
    """The ValueError a best-fit loader over two small shards raises for resume_state_dict=state."""
    data_dir = str(tmp_path / "shards")
    write_shards(data_dir, [_docs(20, 0), _docs(5, 1)], 5)
    with pytest.raises(ValueError) as info:
        next(tokenizing_distributed_data_loader_with_state_bos_bestfit(
            tokenizer, 2, 8, "train", device="cpu", data_dir=data_dir, resume_state_dict=state))
    return str(info.value)


def test_a_models_state_dict_is_not_a_loader_state(tmp_path, byte_tokenizer):
    message = _resume_error(tmp_path, byte_tokenizer, MODEL)
    assert message == (
        "resume_state_dict is not a loader state (its keys are 'transformer.wte.weight', "
        "'transformer.h.0.attn.c_q.weight', 'lm_head.weight' and 1 more, and it holds tensors: a "
        f"model's or an optimizer's state dict?). {WHAT_IT_IS}")
    assert "missing" not in message


def test_an_optimizers_state_dict_is_not_a_loader_state(tmp_path, byte_tokenizer):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1).state_dict()
    assert _resume_error(tmp_path, byte_tokenizer, optimizer) == (
        "resume_state_dict is not a loader state (its keys are 'state', 'param_groups'). "
        f"{WHAT_IT_IS}")


def test_merge_states_of_a_models_state_dict(tmp_path):
    with pytest.raises(ValueError) as info:
        merge_states([MODEL], 2, data_dir=str(tmp_path))
    assert str(info.value).startswith("states[0] is not a loader state (its keys are ")
    assert str(info.value).endswith(WHAT_IT_IS)


def test_a_mixture_loader_given_a_models_state_dict_says_so():
    """(mixture_start is the mixture loader's first look at resume_state_dict)"""
    with pytest.raises(ValueError) as info:
        mixture_start(MODEL, {}, 0, 1, False)
    assert str(info.value).startswith("resume_state_dict is not a loader state (its keys are ")
    assert str(info.value).endswith(WHAT_IT_IS)


def test_a_truncated_state_still_says_what_is_missing(tmp_path, byte_tokenizer):
    assert (_resume_error(tmp_path, byte_tokenizer, {"pq_idx": 0})
            == "resume_state_dict is missing ['rg_idx']")


# -----------------------------------------------------------------------------
# --help

# (module, subcommand): every command a user runs, as `python -m MODULE [SUBCOMMAND] --help`
COMMANDS = [("nanochat.dataset", []), ("nanochat.dataset", ["repackage"]),
            ("nanochat.dataset", ["serve"]), ("nanochat.pretokenize", []),
            ("nanochat.mixture", ["validate"]), ("nanochat.tokenizer", ["convert"]),
            ("nanochat.tokenizer", ["export-hf"]), ("nanochat.shard_cache", ["status"]),
            ("scripts.demo", []), ("scripts.tok_train", []), ("scripts.tok_eval", []),
            ("scripts.base_train", []), ("scripts.record_behaviour", []),
            ("scripts.nanochat_dropin", []), ("scripts.main_path", [])]


@pytest.mark.parametrize("module, command", COMMANDS,
                         ids=[" ".join([m, *c]) for m, c in COMMANDS])
def test_every_help_says_what_the_command_does(module, command, capsys, monkeypatch):
    """The description, between the usage and the first list of arguments, is there, and ends on
    a whole sentence: not on a colon that introduces nothing."""
    monkeypatch.setenv("COLUMNS", "100")  # (argparse wraps to the terminal's width)
    with pytest.raises(SystemExit) as done:
        importlib.import_module(module).main([*command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    usage, _, rest = text.partition("\n\n")
    assert usage.startswith(f"usage: python -m {module} {' '.join(command)}".rstrip()), usage
    description = re.split(r"^(?:positional arguments|options):$", rest, flags=re.M)[0].strip()
    assert description, f"python -m {module} {' '.join(command)} --help has no description"
    assert not description.endswith(":"), description[-200:]

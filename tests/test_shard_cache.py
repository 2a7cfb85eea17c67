"""
nanochat/shard_cache.py, the `python -m nanochat.shard_cache status [DATA_DIR]` command, run in
this process through main(): on an empty directory, on one holding a user's shard, on a missing
one, on the default data directory, and without a command (the subprocess runs, with a live
cache, are in tests/data/streaming/test_cache_status.py).
Run: python -m pytest tests/test_shard_cache.py -q
"""

import os

import pytest

from nanochat.data.base.datasets import index_to_filename
from nanochat.data.streaming.ledger import STREAM_DIR
from nanochat.shard_cache import main


def test_status_of_an_empty_directory(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) == 0
    assert capsys.readouterr() == (
        f"streaming cache in {tmp_path}\n"
        "on disk: 0 bytes: 0 shard files, 0 bytes, and 0 kept copies, 0 bytes\n"
        "cache_limit: none (no live loader has one)\n"
        "live loaders: 0\n"
        "needs of the live loaders: 0\n"
        "kept for buffers (.stream/kept): 0 copies\n"
        "evicted, not fetched since: none (0 evictions in all)\n", "")
    assert os.listdir(tmp_path) == []  # looking writes nothing


def test_status_of_a_directory_never_streamed_into(tmp_path, capsys):
    (tmp_path / index_to_filename(0)).write_bytes(b"x" * 2500)
    assert main(["status", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.splitlines()[:5] == [
        f"streaming cache in {tmp_path}",
        "on disk: 2.5 KB: 1 shard file, 2.5 KB, and 0 kept copies, 0 bytes",
        "cache_limit: none (no live loader has one)",
        "  shard_00000.parquet       2.5 KB  yours",
        "  (yours: not fetched by a streaming loader; never evicted)"]
    assert not (tmp_path / STREAM_DIR).exists()


def test_status_of_a_missing_directory_is_status_1_and_one_line(tmp_path, capsys):
    assert main(["status", str(tmp_path / "missing")]) == 1
    assert capsys.readouterr() == ("", f"{tmp_path / 'missing'} is not a directory\n")
    (tmp_path / "a_file").write_bytes(b"x")
    assert main(["status", str(tmp_path / "a_file")]) == 1
    assert capsys.readouterr() == ("", f"{tmp_path / 'a_file'} is not a directory\n")
    # no DATA_DIR: the dataset's directory under NANOCHAT_BASE_DIR (conftest's, not made yet)
    assert main(["status"]) == 1
    default = os.path.join(os.environ["NANOCHAT_BASE_DIR"], "base_data_climbmix")
    assert capsys.readouterr() == ("", f"{default} is not a directory\n")


def test_without_a_command_argparse_exits_2_with_the_usage(capsys):
    with pytest.raises(SystemExit) as stopped:
        main([])
    assert stopped.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("usage: python -m nanochat.shard_cache [-h] {status}")
    assert err.endswith("error: the following arguments are required: command\n")

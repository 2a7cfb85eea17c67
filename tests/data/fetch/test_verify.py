"""
Tests for the checks of a file on disk (nanochat/data/fetch/verify.py): pages read once per file,
a corrupt page installed earlier found by the downloader, by a streaming loader and by --verify,
with the command that fixes it. Against the fault-injecting local HTTP server of conftest.py
(`fault_server`). Hermetic: no internet, tiny shards in tmp_path. Run:
    python -m pytest tests/data/fetch/test_verify.py -q
"""

import json
import os
import re

import pytest

from conftest import (FAST_BACKOFF, assert_only_complete_shards, bit_flipped, ByteTokenizer,
                      corrupt_page, dataset_cli, download_shard, serve_shards, sha256_hex)
from nanochat.data.fetch import verify
from nanochat.data.fetch.limits import Limits
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat.data.base.datasets import index_to_filename
from nanochat.dataset import main, parquets_iter_batched

NAME = index_to_filename(0)  # the shard most tests fetch


def test_pages_are_read_once_per_file(fault_server, tmp_path, monkeypatch):
    served = serve_shards(fault_server, tmp_path, [0, 1])
    data_dir = tmp_path / "data"
    fault_server.etag = "md5"
    # no sha256 stated: its pages are read to install it
    assert download_shard(fault_server, tmp_path, 0)
    fault_server.etag = "sha256"
    assert download_shard(fault_server, tmp_path, 1)  # the publisher's sha256 matched: they are not
    read = []
    monkeypatch.setattr(verify, "check_pages", lambda path: read.append(os.path.basename(path)))
    for _ in range(2):  # a file's record vouches for its pages from then on
        assert download_shard(fault_server, tmp_path, 0)
        assert download_shard(fault_server, tmp_path, 1)
        assert verify.check_files([str(data_dir / NAME)]) == {}
    assert read == []
    # a record without the mark (an earlier downloader's): read once, then marked
    record = json.loads((data_dir / f"{NAME}.json").read_text())
    del record["pages_checked"]
    (data_dir / f"{NAME}.json").write_text(json.dumps(record))
    for _ in range(2):
        assert download_shard(fault_server, tmp_path, 0)
    assert read == [NAME]
    assert json.loads((data_dir / f"{NAME}.json").read_text())["pages_checked"] is True
    assert fault_server.gets == {NAME: 1, "shard_00001.parquet": 1}
    assert_only_complete_shards(data_dir, served)


def _install_corrupt(data_dir, body: bytes) -> None:
    """shard 0 with a corrupt page and the record a downloader without the page check wrote for
    it: the sha256 of those bytes, none stated by the server, no pages_checked."""
    data_dir.mkdir(exist_ok=True)
    bad = corrupt_page(body)
    (data_dir / NAME).write_bytes(bad)
    (data_dir / f"{NAME}.json").write_text(json.dumps(
        {"size": len(bad), "sha256": sha256_hex(bad), "sha256_stated_by_server": False}))


def test_a_corrupt_page_installed_earlier_is_found_and_its_fix_works(fault_server, tmp_path,
                                                                     capsys):
    served = serve_shards(fault_server, tmp_path, [0, 1, 6542])
    data_dir = tmp_path / "data"
    assert dataset_cli(fault_server, data_dir, "-n", "2") == 0
    _install_corrupt(data_dir, served[0])
    # the reader's error names the file, the row group and the fix
    with pytest.raises(ValueError) as info:
        list(parquets_iter_batched("train", data_dir=str(data_dir)))
    message = str(info.value)
    assert f"{data_dir / NAME} row group 1 could not be read (ZSTD" in message
    fix = f"python -m nanochat.dataset --verify --data-dir {data_dir}"
    assert fix in message
    # the fix as the error states it: --verify names the shard and the command that fetches it
    capsys.readouterr()
    assert main(fix.split()[3:]) == 1
    out = capsys.readouterr().out
    assert "  1 x corrupt page: shard_00000.parquet\n" in out
    command = re.search(r"to fix: (python -m nanochat\.dataset .*?) \(", out).group(1)
    assert main(command.split()[3:] + ["--base-url", fault_server.url, *FAST_BACKOFF]) == 0
    assert "  1 x corrupt page: shard_00000.parquet\n" in capsys.readouterr().out
    assert main(fix.split()[3:]) == 0
    assert_only_complete_shards(data_dir, served)
    assert len(list(parquets_iter_batched("train", data_dir=str(data_dir)))) == 10


def test_a_streaming_loader_replaces_a_corrupt_shard_installed_earlier(fault_server, tmp_path):
    served = serve_shards(fault_server, tmp_path, [0, 6542])
    cache = tmp_path / "cache"
    _install_corrupt(cache, served[0])
    args = dict(B=2, T=16, split="train", device="cpu", tokenizer_batch_size=8)
    expected = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), data_dir=str(tmp_path / "served"), **args)
    streamed = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), data_dir=str(cache), stream=True, num_shards=1, base_url=fault_server.url,
        download_limits=Limits(backoff_base=0.01), **args)
    try:
        for _ in range(40):  # the buffer's first fill reads every row group of shard 0
            (inputs, targets, _), (x, y, _) = next(streamed), next(expected)
            assert inputs.tolist() == x.tolist() and targets.tolist() == y.tolist()
    finally:
        streamed.close()
        expected.close()
    assert (cache / NAME).read_bytes() == served[0]
    assert fault_server.gets[NAME] == 1  # fetched again, whole


def test_verify_names_bad_shards_and_the_fix(fault_server, tmp_path, capsys):
    served = serve_shards(fault_server, tmp_path, [0, 1, 2, 6542])
    data_dir = tmp_path / "data"
    assert dataset_cli(fault_server, data_dir, "-n", "3") == 0
    assert main(["--verify", "--data-dir", str(data_dir)]) == 0
    assert f"checked 4 shards in {data_dir}: 4 good, 0 bad\n" in capsys.readouterr().out
    (data_dir / "shard_00001.parquet").write_bytes(bit_flipped(served[1]))
    (data_dir / "shard_00002.parquet").write_bytes(b"")
    os.remove(data_dir / "shard_00002.parquet.json")
    (data_dir / "notes.parquet").write_bytes(b"PAR1 scribbles")
    fault_server.gets.clear()
    fault_server.heads.clear()
    assert main(["--verify", "--data-dir", str(data_dir)]) == 1
    out = capsys.readouterr().out
    assert f"checked 5 shards in {data_dir}: 2 good, 3 bad\n" in out
    assert "2 have no .json record" in out
    assert ("  2 x not parquet: notes.parquet, shard_00002.parquet\n"
            "  1 x sha256 mismatch: shard_00001.parquet\n") in out
    # the fix fetches only what the downloader fetched (shard_00002 lost its record)
    assert (f"to fix: python -m nanochat.dataset --dataset climbmix-400b --data-dir {data_dir}"
            " -n 2 ") in out
    assert ("not fetchable from climbmix-400b (named unlike its shards, or outside its "
            "directory with no .json record), so nothing here downloads them: "
            "notes.parquet, shard_00002.parquet; write them again") in out
    assert not fault_server.gets and not fault_server.heads  # offline
    # the fix it names works
    os.remove(data_dir / "notes.parquet")
    assert dataset_cli(fault_server, data_dir, "-n", "3") == 0
    assert main(["--verify", "--data-dir", str(data_dir)]) == 0
    assert_only_complete_shards(data_dir, served)

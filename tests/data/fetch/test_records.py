"""
Tests for the records beside a fetched file (nanochat/data/fetch/records.py): a symlink at the
temp or lock name is refused and its target never touched, and a record that does not read means
the file is fetched again. Against the fault-injecting local HTTP server of conftest.py
(`fault_server`). Hermetic: no internet, tiny shards in tmp_path. Run:
    python -m pytest tests/data/fetch/test_records.py -q
"""

import os

import pytest

from conftest import assert_only_complete_shards, dataset_cli, serve_shards
from nanochat.data.base.datasets import index_to_filename

NAME = index_to_filename(0)  # the shard most tests fetch


@pytest.mark.parametrize("link", [f"{NAME}.tmp", f".{NAME}.lock"])
def test_symlinked_temp_or_lock_file_is_refused_and_its_target_untouched(
        fault_server, tmp_path, link, capsys):
    serve_shards(fault_server, tmp_path, [0, 6542])
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    target = tmp_path / "precious.txt"
    target.write_bytes(b"PAR1 keep me")
    os.symlink(target, data_dir / link)
    assert dataset_cli(fault_server, data_dir, "-n", "1") == 1
    assert "  1 x symlink in the way: shard_00000.parquet" in capsys.readouterr().out
    assert target.read_bytes() == b"PAR1 keep me"
    assert os.path.islink(data_dir / link) and not os.path.exists(data_dir / NAME)
    assert fault_server.gets[NAME] == 0


def test_unreadable_record_means_fetch_again(fault_server, tmp_path, capsys):
    served = serve_shards(fault_server, tmp_path, [0, 6542])
    data_dir = tmp_path / "data"
    assert dataset_cli(fault_server, data_dir, "-n", "1") == 0
    (data_dir / f"{NAME}.json").write_text('{"size": 12')
    assert dataset_cli(fault_server, data_dir, "-n", "1") == 0
    assert "  1 x unreadable record: shard_00000.parquet\n" in capsys.readouterr().out
    assert fault_server.gets[NAME] == 2
    assert_only_complete_shards(data_dir, served)

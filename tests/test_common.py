"""
nanochat/common.py: where data lives (get_base_dir, from NANOCHAT_BASE_DIR or the home directory)
and who we are in a torchrun job (get_dist_info from RANK / LOCAL_RANK / WORLD_SIZE, print0).
Run: python -m pytest tests/test_common.py -q
"""

import os

import pytest

from nanochat.common import get_base_dir, get_dist_info, print0


def test_the_base_dir_is_the_variable_else_the_cache_under_home(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    assert get_base_dir() == str(tmp_path / "base")
    assert not (tmp_path / "base").exists()  # resolved, not created
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in (lambda: monkeypatch.setenv("NANOCHAT_BASE_DIR", ""),  # empty counts as unset
                  lambda: monkeypatch.delenv("NANOCHAT_BASE_DIR")):
        unset()
        assert get_base_dir() == os.path.join(str(tmp_path / "home"), ".cache", "nanochat")


def test_outside_torchrun_one_process_of_rank_0(monkeypatch):
    assert get_dist_info() == (False, 0, 0, 1)
    monkeypatch.setenv("RANK", "1")  # torchrun sets all three: one or two alone are not a job
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert get_dist_info() == (False, 0, 0, 1)


def test_torchrun_variables_give_rank_local_rank_and_world_size(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert get_dist_info() == (True, 5, 1, 8)


@pytest.mark.parametrize("rank, world_size, message", [
    ("8", "8", r"^inconsistent torchrun variables: RANK=8, WORLD_SIZE=8$"),
    ("0", "0", r"^inconsistent torchrun variables: RANK=0, WORLD_SIZE=0$"),
    ("-1", "2", r"^inconsistent torchrun variables: RANK=-1, WORLD_SIZE=2$"),
    ("one", "2", r"^environment variable RANK must be an integer, got 'one'$"),
])
def test_bad_torchrun_variables_are_refused_by_name(monkeypatch, rank, world_size, message):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", world_size)
    with pytest.raises(ValueError, match=message):
        get_dist_info()


def test_print0_prints_on_rank_0_only(monkeypatch, capsys):
    print0("hello", 1, sep="-")
    monkeypatch.setenv("RANK", "0")
    print0("again")
    monkeypatch.setenv("RANK", "3")
    print0("not shown")
    assert capsys.readouterr().out == "hello-1\nagain\n"

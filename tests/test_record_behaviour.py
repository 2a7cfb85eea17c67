"""
scripts/record_behaviour.py: two recordings made by two processes (with different hash seeds) are
the same bytes and `compare` calls them identical; a recording with one hash or one state changed
makes `compare` exit 1 naming the configuration, the step and the field; bad arguments exit 2 with
the file named.
Run: python -m pytest tests/test_record_behaviour.py -q (~7 s)
"""

import json
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, worker_env
from scripts.record_behaviour import main

FIRST = ("bestfit train data=parquet B=2 T=32 buffer_size=8 tokenizer_batch_size=4 "
         "trace_documents=True attention_info=True rank=0 world_size=1")


def record(paths_and_seeds) -> None:
    """Recordings made side by side, each by its own process with its own hash seed."""
    command = [sys.executable, "-m", "scripts.record_behaviour", "record"]
    runs = [subprocess.Popen(command + [str(path)], cwd=REPO_ROOT,
                             env=dict(worker_env(), PYTHONHASHSEED=str(seed)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for path, seed in paths_and_seeds]
    try:
        for run in runs:
            output = run.communicate(timeout=300)[0]
            assert run.returncode == 0, output
    finally:
        for run in runs:
            run.kill()
            run.wait()


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    root = tmp_path_factory.mktemp("recordings")
    record([(root / "a.json", 1), (root / "b.json", 2)])
    return root / "a.json", root / "b.json"


def compare(old, new, capsys) -> tuple[int, list[str]]:
    code = main(["compare", str(old), str(new)])
    return code, capsys.readouterr().out.splitlines()


@pytest.mark.slow
def test_two_recordings_are_identical(recordings, capsys):
    a, b = recordings
    assert a.read_bytes() == b.read_bytes()
    code, lines = compare(a, b, capsys)
    assert code == 0
    recording = json.loads(a.read_text())
    names = list(recording["configurations"])
    # not vacuous: every kind of loader, resume and merge ran, with steps and states
    for kind in ("bestfit", "concat", "pretokenized", "mixture", "resumed after", "elastic 3->2"):
        assert any(kind in name for name in names), kind
    assert all(recording["configurations"][name] for name in names)
    assert lines[-1] == (f"identical: all {len(names)} configurations and "
                         f"{len(recording['files'])} files")
    assert f"{FIRST}: identical (16 steps)" in lines


def tampered(path, tmp_path, change):
    data = json.loads(path.read_text())
    change(data["configurations"])
    out = tmp_path / "tampered.json"
    out.write_text(json.dumps(data))
    return out


@pytest.mark.slow
def test_a_changed_hash_is_found(recordings, tmp_path, capsys):
    a, _ = recordings

    def flip(configurations):
        targets = configurations[FIRST][2]["targets"]  # step 3
        targets["sha256"] = ("0" if targets["sha256"][0] != "0" else "1") + targets["sha256"][1:]
    code, lines = compare(a, tampered(a, tmp_path, flip), capsys)
    assert code == 1
    different = [line for line in lines if "DIFFERENT" in line]
    assert len(different) == 2 and different[0].startswith(
        f"{FIRST}: DIFFERENT at step 3, field 'targets'['sha256']")
    assert different[1] == (f"DIFFERENT: 1 of {len(json.loads(a.read_text())['configurations'])} "
                            "configurations")


@pytest.mark.slow
def test_a_changed_state_names_its_key(recordings, tmp_path, capsys):
    a, _ = recordings

    def edit(configurations):
        record = configurations[FIRST][4]  # step 5, a state short enough to be kept as text
        state = json.loads(record["state"]["json"])
        state["next"][3] += 1
        record["state"]["json"] = json.dumps(state, sort_keys=True)
    code, lines = compare(a, tampered(a, tmp_path, edit), capsys)
    old_row = json.loads(
        json.loads(a.read_text())["configurations"][FIRST][4]["state"]["json"])["next"][3]
    assert code == 1
    assert (f"{FIRST}: DIFFERENT at step 5, field 'state'['next'][3]: old {old_row}, "
            f"new {old_row + 1}") in lines


@pytest.mark.slow
def test_a_missing_step_is_found(recordings, tmp_path, capsys):
    a, _ = recordings
    code, lines = compare(a, tampered(a, tmp_path,
                                      lambda configurations: configurations[FIRST].pop()), capsys)
    assert code == 1
    assert f"{FIRST}: DIFFERENT at step 16: old has 16 steps, new 15" in lines


@pytest.mark.slow
def test_bad_arguments(recordings, tmp_path, capsys):
    a, _ = recordings
    assert main(["compare", str(a), str(tmp_path / "missing.json")]) == 2
    assert f"recording {tmp_path / 'missing.json'} does not exist" in capsys.readouterr().err
    (tmp_path / "not.json").write_text("{")
    assert main(["compare", str(tmp_path / "not.json"), str(a)]) == 2
    assert f"{tmp_path / 'not.json'} is not a recording: not JSON" in capsys.readouterr().err
    # an existing recording is never overwritten without --force, and a used --work directory is
    # refused
    assert main(["record", str(a)]) == 2
    assert f"{a} exists; record to another file, or pass --force" in capsys.readouterr().err
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "mine.txt").write_text("keep me")
    assert main(["record", str(tmp_path / "new.json"), "--work", str(tmp_path / "work")]) == 2
    assert "is not an empty directory" in capsys.readouterr().err
    assert ((tmp_path / "work" / "mine.txt").read_text() == "keep me"
            and not (tmp_path / "new.json").exists())

"""
The lock on a pretokenize run's output (nanochat/data/processing/output_lock.py): one per rank,
a note of who holds it while held and an empty file after, and a second run of the same rank
stopped with a TimeoutError naming the holder and the way to run several at once. Run:
    python -m pytest tests/data/processing/test_output_lock.py -q
"""

import os
import socket

import pytest

from nanochat.data.processing.output_lock import output_lock


def test_a_held_output_is_refused_naming_its_holder(tmp_path, capsys):
    out = str(tmp_path / "out")
    path = os.path.join(out, ".pretokenize.lock")
    with output_lock(out, 0, 1, 0.0):
        with open(path) as f:
            note = f.read()
        assert note.startswith(f"pid {os.getpid()} on {socket.gethostname()}, since ")
        with pytest.raises(TimeoutError) as info:
            with output_lock(out, 0, 1, 0.0):
                pass
        message = str(info.value)
        assert message.startswith(f"another pretokenize run ({note.strip()}) is writing to {out}")
        assert "--rank R --world-size N" in message and "that run is rank" not in message
        assert capsys.readouterr().out == ""  # no wait announced for a timeout of 0
        # the ranks of one job lock their own shares, so they run at once
        with output_lock(out, 1, 2, 0.0):
            assert os.path.exists(os.path.join(out, ".pretokenize.rank1-of-2.lock"))
    with open(path) as f:
        assert f.read() == ""  # nobody holds it now


def test_a_wait_is_announced(tmp_path, capsys):
    out = str(tmp_path / "out")
    with output_lock(out, 1, 2, 0.0):
        with pytest.raises(TimeoutError, match=r"\(that run is rank 1 of 2 too\)"):
            with output_lock(out, 1, 2, 0.05):
                pass
    assert capsys.readouterr().out.startswith("waiting up to 0.05s (--lock-timeout) for another "
                                              "pretokenize run (pid ")

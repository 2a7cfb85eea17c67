"""
nanochat/data/base/cli.py, how a command line ends: run() exits with main()'s status; a mistake in
the input (one of `errors`) prints one `error: ...` line and exits 2 (or error_status); Ctrl-C
prints one `interrupted: ...` line and exits 130; any other exception is not caught.
Run: python -m pytest tests/data/base/test_cli.py -q
"""

import sys

import pytest

from nanochat.data.base.cli import INTERRUPTED, run


def raising(error: BaseException):
    def main():
        raise error
    return main


def exit_of(capsys, *args, **kwargs) -> tuple:
    """(the status run() exits with, what it printed to stdout, to stderr)."""
    with pytest.raises(SystemExit) as stopped:
        run(*args, **kwargs)
    out, err = capsys.readouterr()
    return stopped.value.code, out, err


def test_run_exits_with_mains_status(capsys):
    assert exit_of(capsys, lambda: 0, "stopped") == (0, "", "")
    assert exit_of(capsys, lambda: 3, "stopped") == (3, "", "")
    assert exit_of(capsys, lambda: None, "stopped") == (None, "", "")  # the shell's 0


def test_an_input_error_is_one_line_and_status_2(capsys):
    main = raising(ValueError("shards.txt: no such split 'test'; pass train or val"))
    line = "error: shards.txt: no such split 'test'; pass train or val\n"
    assert exit_of(capsys, main, "stopped", (ValueError,)) == (2, "", line)
    assert exit_of(capsys, main, "stopped", (OSError, ValueError), 7) == (7, "", line)


def test_an_error_not_named_in_errors_is_not_caught(capsys):
    with pytest.raises(ValueError, match="^a bug$"):
        run(raising(ValueError("a bug")), "stopped", (OSError,))
    with pytest.raises(ValueError, match="^a bug$"):
        run(raising(ValueError("a bug")), "stopped")  # no errors: none is caught
    assert capsys.readouterr() == ("", "")


def test_ctrl_c_is_one_line_and_status_130(capsys, monkeypatch):
    assert INTERRUPTED == 130
    main = raising(KeyboardInterrupt())
    assert exit_of(capsys, main, "nothing written; rerun it", (KeyboardInterrupt,)) == (
        130, "", "interrupted: nothing written; rerun it\n")  # never the `error:` line
    monkeypatch.setattr(sys, "argv", ["prog", "status", "/data"])
    said = exit_of(capsys, main, lambda args: f"{' '.join(args)} stopped")
    assert said == (130, "", "interrupted: status /data stopped\n")

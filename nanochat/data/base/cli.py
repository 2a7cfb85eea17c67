"""
How a command line ends: `run(main, interrupted, errors)` exits with main()'s status.
A mistake in the input (one of `errors`) prints one line, `error: ...`, and exits 2 (or
error_status). Ctrl-C prints one line to stderr, `interrupted: ...`, that says what stopped and what
a rerun does, and exits 130 (128 + SIGINT, as a shell reports it): never a traceback. What a command
leaves behind when it stops is its own design, and its line says it: complete files under their
names, partial ones under temporary names that a rerun resumes or writes again.

May import: the standard library.
"""

import signal
import sys
from typing import Callable, NoReturn

INTERRUPTED = 128 + signal.SIGINT  # 130: the status a shell gives a command Ctrl-C stopped


def run(main: Callable[[], int | None], interrupted: str | Callable[[list[str]], str],
        errors: tuple = (), error_status: int = 2) -> NoReturn:
    """sys.exit(main()), with one line for each of `errors` and for Ctrl-C. interrupted: what Ctrl-C
    prints after "interrupted: ", or a function of the command's arguments (sys.argv[1:]) that
    returns it (a command with subcommands)."""
    try:
        status = main()
    except KeyboardInterrupt:
        line = interrupted(sys.argv[1:]) if callable(interrupted) else interrupted
        print(f"interrupted: {line}", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)
    except errors as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(error_status)
    sys.exit(status)

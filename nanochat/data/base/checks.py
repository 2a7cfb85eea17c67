"""
The one integer check that every argument, field and setting goes through.
Bad input then gets the same kind of message everywhere: the name, the range, the value and, where
it helps, a hint.

May import: nothing of ours.
"""

import reprlib

import numpy as np


def is_int(value, numpy: bool = False) -> bool:
    """An int (numpy: or a numpy integer); a bool is not one (True == 1 would slip through as a
    count). A numpy integer is refused by default: a loader's B or T of np.int64 would fail later,
    deep inside (JSON cannot write it), instead of here."""
    kinds = (int, np.integer) if numpy else int
    return isinstance(value, kinds) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value, low: int | None = None, high: int | None = None, *,
              hint: str = "", error: type[Exception] = ValueError) -> int:
    """Return value as an int if it is one in [low, high] (either bound may be None), else raise
    `error` naming `name`. hint: words put after the range, e.g. " (0 = no background threads)"."""
    if is_int(value) and (low is None or value >= low) and (high is None or value <= high):
        return int(value)
    if low is not None and high is not None:
        bounds = f" in [{low}, {high}]"
    elif low is not None:
        bounds = f" >= {low}"
    elif high is not None:
        bounds = f" <= {high}"
    else:
        bounds = ""
    # reprlib: a state's field can be a long list; the message shows its start
    raise error(f"{name} must be an integer{bounds}{hint}, got {reprlib.repr(value)}")

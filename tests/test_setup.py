"""The set-up's promise: the torch in .venv is the one scripts/setup.sh asked for.

    python -m pytest tests/test_setup.py -q

setup.sh writes its torch requirement to .venv/nanochat-torch; run from that .venv, the installed
torch must satisfy it, and a `+cpu` pin must be a build without CUDA.
"""

import os
import sys

import pytest
import torch

from conftest import REPO_ROOT
from scripts.check_torch import mismatch

CHOSEN = os.path.join(REPO_ROOT, ".venv", "nanochat-torch")


def in_setup_venv():
    return os.path.exists(CHOSEN) and os.path.realpath(sys.prefix) == os.path.realpath(
        os.path.join(REPO_ROOT, ".venv"))


@pytest.mark.skipif(not in_setup_venv() and os.environ.get("CI") != "true",
                    reason="not running in the .venv that scripts/setup.sh made")
def test_installed_torch_is_the_one_setup_chose():
    assert os.path.exists(CHOSEN), f"{CHOSEN} is missing: CI runs from the .venv setup.sh made"
    with open(CHOSEN) as f:
        requirement = f.read().strip()
    assert mismatch(requirement) is None, mismatch(requirement)


def test_mismatch_names_both_sides():
    have = torch.__version__
    assert mismatch(f"torch=={have}") is None
    assert mismatch("torch>=1.0") is None
    problem = mismatch("torch==1.0.0")
    assert problem is not None and "torch==1.0.0" in problem and have in problem
    if torch.version.cuda is not None:  # a CUDA build is never the +cpu one, whatever its number
        assert "CUDA" in mismatch(f"torch=={have.split('+')[0]}+cpu")

"""
Tests for the helpers of tests/conftest.py that decide whether a test runs: `need` and
`skip_unless_ci` skip a test whose optional tool is missing, except where the environment variable
CI is set, where they fail it (a CI run must never pass by skipping).
Run: python -m pytest tests/test_conftest.py -q
"""

import json

import pytest

from conftest import need, skip_unless_ci

MISSING = "nanochat_no_such_module"


def test_need_returns_the_module():
    assert need("json", "it is in the standard library") is json


def test_a_missing_module_skips_here(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=f"{MISSING} is not installed: pip install it"):
        need(MISSING, "pip install it")


def test_a_missing_module_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception,
                       match=f"CI is set and {MISSING} is not installed: pip install it"):
        need(MISSING, "pip install it")
    with pytest.raises(pytest.fail.Exception, match="CI is set and no tool"):
        skip_unless_ci("no tool")

"""Shared test helpers: fixture paths and small GGUF byte surgery."""

from __future__ import annotations

import os

import pytest

from harness.fixtures.synthetic import build

# The reference cache (harness/runs/reference_cache.py) is off for the suite, subprocesses
# included: a test that fakes or breaks the reference must see it run. Its own tests turn it on
# in a temporary folder.
os.environ["HARNESS_REFERENCE_CACHE"] = "off"


@pytest.fixture(scope="session")
def tiny_path():
    return build("tiny-qwen35")


@pytest.fixture(scope="session")
def tiny_moe_path():
    return build("tiny-qwen35moe")

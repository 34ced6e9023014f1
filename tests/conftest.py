"""Shared test helpers: fixture paths and small GGUF byte surgery."""

from __future__ import annotations

import pytest

from harness.fixtures.synthetic import build


@pytest.fixture(scope="session")
def tiny_path():
    return build("tiny-qwen35")


@pytest.fixture(scope="session")
def tiny_moe_path():
    return build("tiny-qwen35moe")

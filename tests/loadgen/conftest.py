"""Fixtures for the load generator tests: a fake OpenAI-compatible SSE server (fake_openai.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loadgen.fake_openai import FakeServer, serve_in_thread


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    """A server on a free port, stopped after the test."""
    yield from serve_in_thread()

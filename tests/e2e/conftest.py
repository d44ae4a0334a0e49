"""Fixtures shared by the end-to-end tests of real harness binaries."""

import pytest

from tests.support.harness import FakeBackend


@pytest.fixture
def backend(qwen_tokenizer_dir):
    """The fake SGLang backend with its default script, in its own process."""
    b = FakeBackend(qwen_tokenizer_dir)
    yield b
    b.stop()

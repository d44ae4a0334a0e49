"""Fixtures shared by the end-to-end tests of real harness binaries."""

import os

import pytest

from tests.e2e.harness import FakeBackend


@pytest.fixture
def backend(qwen_tokenizer_dir):
    """The fake SGLang backend with its default script, in its own process."""
    b = FakeBackend(qwen_tokenizer_dir)
    yield b
    b.stop()


IMAGE = os.environ.get("POLAR_MITM_TEST_IMAGE", "polar-mitm/rollout-base:bookworm")


@pytest.fixture(scope="session")
def docker_client():
    """The Docker daemon, with the base image tests run tasks in (`bash scripts/docker.sh`)."""
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env()
        client.ping()
        client.images.get(IMAGE)
    except Exception as e:
        pytest.fail(f"Docker with the test image {IMAGE} is needed: run `bash scripts/docker.sh` ({e})")
    return client

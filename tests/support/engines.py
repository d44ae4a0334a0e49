"""What the `engines` tests share across real engines (SGLang, vLLM on CPU): the venv an engine
runs from, the tiny model it serves, its server process, and a recording hop between the proxy and
the engine.

- `engine_python`: the interpreter of an engine's venv that scripts/install.sh builds (stamped
  when its build passed); skips the test, saying how to build it, only where the venv is absent.
- `make_tiny_model`: `polar_mitm.fake.hf.tiny_causal_lm` over a tokenizer (its whole vocabulary,
  so every id the proxy sends has an embedding), with the tokenizer's files beside the weights
  for the engine's detokenizer. Built with this venv's torch where it has one, else with the
  engine's.
- `EngineServer`: an engine's HTTP server in its own process group on a free loopback port,
  ready once its liveness path answers, stopped by signalling the whole group (the engines'
  schedulers and workers are child processes), even when it never became ready.
- `RecordingHop`: an aiohttp reverse proxy on its own thread that forwards everything to the
  engine and keeps each generation's request body and the raw bytes of its reply, streamed or
  not: what the engine really said, to compare the store with.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, ClientTimeout, web

from polar_mitm import procs
from polar_mitm.cache import cache_dir
from tests.support.harness import POLAR, free_port

# The tokenizer's files the engines read; the model's own config.json / generation_config.json stay.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


# A harness request at temperature 0.5, three times (the OpenAI SDK from scripts/install.sh's SDK
# venv; the Anthropic SDK 2.15 takes no temperature any more).
HALF_TEMPERATURE_CLIENT = """\
import openai
c = openai.OpenAI()
for i in range(3):
    m = c.chat.completions.create(model="gpt-5", max_tokens=64, temperature=0.5,
        messages=[{"role": "user", "content": f"Count to {i + 3}."}])
    print(m.choices[0].finish_reason)
"""


def sdk_python() -> Path:
    py = cache_dir() / "venvs" / "sdks" / "bin" / "python"
    if not py.exists():
        pytest.fail(f"{py} is missing: scripts/install.sh makes the SDK virtualenv")
    return py


def check_logprobs(db: Path, model: Path, session: str, temperature: float) -> tuple[int, dict]:
    """`polar-mitm check-logprobs` of `session`'s rows against `model` at `temperature`."""
    r = subprocess.run(
        [
            *POLAR,
            "check-logprobs",
            "--model",
            str(model),
            "--db",
            str(db),
            "--session",
            session,
            "--include-side-calls",
            "--temperature",
            str(temperature),
            "--tolerance",
            "1e-4",
            "--max-over",
            "0",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout.strip().splitlines()
    return r.returncode, (json.loads(out[-1]) if out and r.returncode in (0, 1) else {"stderr": r.stderr})


# A short chat prompt in the Qwen tokenizer's ids (user "Hello", then the assistant's header).
CHAT_PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]


def recomputed_logprobs(
    model_dir: Path, prompt: list[int], response: list[int], temperature: float, top_k: int | None = None
) -> list[float]:
    """transformers' logprob of each response token at `temperature`, and with `top_k` of the
    distribution cut to its `top_k` most likely tokens and renormalized (what vLLM samples from)."""
    import torch

    from polar_mitm.fake.hf import load_causal_lm

    ids = torch.tensor([prompt + response], dtype=torch.long)
    with torch.no_grad():
        logits = load_causal_lm(model_dir)(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(response, dtype=torch.long)[:, None])[:, 0].tolist()


def engine_python(venv: Path, stamp: str, how: str) -> Path:
    """`venv`'s python; skips the test where there is no venv (`how`: how to get one), fails where
    its build did not finish (a venv without install.sh's `stamp` is a broken one, not an absent one)."""
    py = venv / "bin" / "python"
    if not py.exists():
        pytest.skip(f"no {stamp} venv at {venv}: {how}")
    mark = venv / ".polar-mitm-installed"
    if not mark.exists() or mark.read_text().strip() != stamp:
        pytest.fail(f"the venv {venv} is not a finished {stamp} build: run scripts/install.sh again")
    return py


def make_tiny_model(
    tokenizer_dir: Path,
    out: Path,
    *,
    python: Callable[[], Path],
    seed: int = 0,
    eos_share: float = 0.15,
    heads: int = 4,
) -> Path:
    """A tiny Qwen2 (hidden 64) over `tokenizer_dir`'s vocabulary in `out`, ready to serve
    (`eos_share`: how likely its first token is <|im_end|>, `heads`: its attention heads, as
    `tiny_causal_lm` says). Without torch here it is built by the engine's `python()`."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        code = (
            "import sys; from polar_mitm.fake.hf import tiny_causal_lm; "
            "tiny_causal_lm(sys.argv[1], sys.argv[2], seed=int(sys.argv[3]), hidden=64, "
            "eos_share=float(sys.argv[4]), heads=int(sys.argv[5]))"
        )
        repo = Path(__file__).resolve().parents[2]
        subprocess.run(
            [str(python()), "-c", code, str(tokenizer_dir), str(out), str(seed), str(eos_share), str(heads)],
            check=True,
            env={**os.environ, "PYTHONPATH": str(repo)},
            timeout=600,
        )
    else:
        from polar_mitm.fake.hf import tiny_causal_lm

        tiny_causal_lm(tokenizer_dir, out, seed=seed, hidden=64, eos_share=eos_share, heads=heads)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


class EngineServer:
    """`argv` (given the port) on 127.0.0.1 in its own process group, its log in `log`, ready
    once GET `ready_path` answers 200. `name` is for messages."""

    name = "the engine"
    ready_path = "/health"

    def __init__(
        self, argv: Callable[[int], list[str]], env: dict[str, str], log: Path, *, ready_timeout: float = 240
    ):
        self.log_path = log
        self.port = free_port()  # a third-party server: it cannot bind port 0 and say what it got
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            argv(self.port),
            env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: stop() reaches the scheduler and workers
        )
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - self.started

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.proc.returncode}) before it was ready:\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=10) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} was not ready within {timeout:g} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def post(self, path: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, Any]:
        """POST JSON (SGLang answers 400 without `Content-Type: application/json`); status, body."""
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                return r.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        """SIGTERM to the group, 15 s, then SIGKILL to whatever of the group is left."""
        if self.proc.poll() is None:
            procs.signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        procs.kill_group(self.proc.pid)
        self.proc.wait()
        self._log.close()


@dataclass
class Exchange:
    """One generation through the hop: the request body, the reply's status and raw bytes."""

    request: dict[str, Any]
    status: int = 0
    content_type: str = ""
    raw: bytes = b""
    received: int = 0  # bytes of the reply so far (set while it streams; `raw` once it ended)
    at: float = field(default_factory=time.monotonic)  # when the hop read the request

    @property
    def streamed(self) -> bool:
        return bool(self.request.get("stream"))

    def outputs(self) -> list[dict[str, Any]]:
        """The reply's JSON objects: each SSE `data:` payload of a stream (without [DONE]), or
        the one body of a whole reply."""
        if not self.streamed:
            return [json.loads(self.raw)]
        out = []
        for line in self.raw.split(b"\n"):
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload != b"[DONE]":
                    out.append(json.loads(payload))
        return out

    def final(self) -> dict[str, Any]:
        """What the engine finally said: the last chunk (SGLang's chunks repeat everything so far)."""
        return self.outputs()[-1]


@dataclass
class RecordingHop:
    """A reverse proxy to `upstream` on 127.0.0.1 (its own thread and loop), keeping every
    exchange on one of `paths` (the engine's generation endpoints) in `exchanges`."""

    upstream: str
    paths: tuple[str, ...] = ("/generate",)
    exchanges: list[Exchange] = field(default_factory=list)
    url: str = ""
    # Called in the hop's loop after each piece of a recorded reply arrives and before it is
    # relayed: a test acts on the engine there (kills it mid-reply) with no polling lag.
    tap: Callable[[Exchange], None] | None = None

    def start(self) -> RecordingHop:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(30), "the recording hop did not start"
        return self

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._http = ClientSession(timeout=ClientTimeout(total=None))
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        # A short shutdown: a handler still reading from a killed engine must not hold `stop`.
        self._runner = web.AppRunner(app, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        ex = None
        if request.path in self.paths:
            ex = Exchange(json.loads(body))
            self.exchanges.append(ex)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self._http.request(
            request.method, self.upstream + request.path_qs, data=body, headers=headers
        ) as up:
            if ex is not None:
                ex.status, ex.content_type = up.status, up.headers.get("Content-Type", "")
            resp = web.StreamResponse(status=up.status)
            for k in ("Content-Type", "Cache-Control"):
                if k in up.headers:
                    resp.headers[k] = up.headers[k]
            await resp.prepare(request)
            raw, downstream = bytearray(), True
            # Read the engine's reply to its end even when the proxy hangs up first (it may,
            # once the chunk with the finish reason came): the record is the engine's whole reply.
            async for chunk in up.content.iter_any():
                raw.extend(chunk)
                if ex is not None:
                    ex.received = len(raw)
                    if self.tap is not None:
                        self.tap(ex)
                if downstream:
                    try:
                        await resp.write(chunk)
                    except ConnectionError:
                        downstream = False
            if ex is not None:
                ex.raw = bytes(raw)
            if downstream:
                try:
                    await resp.write_eof()
                except ConnectionError:
                    pass
            return resp

    def stop(self) -> None:
        async def close() -> None:
            await self._runner.cleanup()
            await self._http.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

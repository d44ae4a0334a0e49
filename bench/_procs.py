"""The processes a benchmark measures, each in its own OS process so its CPU can be read apart
(`Proc.cpu()`, from /proc) and profiled (`py-spy record --pid`): the fake SGLang backend, the
polar-mitm proxy, bare `mitmdump`, and a trivial HTTP server that answers every request with the
same canned bytes.

Shared by the bench scripts; nothing here is part of the package.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from polar_mitm import procs

VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A started process, its URL, and its CPU time so far."""

    def __init__(self, popen: subprocess.Popen, url: str, log: Path):
        self.popen = popen
        self.url = url
        self.log = log

    @property
    def pid(self) -> int:
        return self.popen.pid

    def cpu(self) -> float:
        """Seconds of CPU used by all of the process's threads (nanosecond schedstat counters)."""
        total = 0
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass  # a thread that just ended
        return total / 1e9

    def stop(self) -> None:
        procs.stop(self.popen, 10, sig=signal.SIGINT)


def _start(argv: list[str], ready: str, log: Path, timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Start argv with stdout+stderr to `log`; wait for a line containing `ready` and return it."""
    out = open(log, "w")  # noqa: SIM115 - the child keeps it
    p = subprocess.Popen(
        argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        for line in text.splitlines():
            if ready in line:
                return p, line
        if p.poll() is not None:
            raise RuntimeError(f"{argv[0]} exited ({p.returncode}):\n{text[-3000:]}")
        time.sleep(0.05)
    p.kill()
    raise RuntimeError(f"{argv[:3]} did not print {ready!r} within {timeout}s:\n{log.read_text()[-3000:]}")


_FAKE = """
import sys
from polar_mitm.fake import FakeBackendConfig, serve
serve(FakeBackendConfig.model_validate_json(sys.argv[1]), "127.0.0.1", int(sys.argv[2]))
"""


def start_fake(tmp: Path, **config: Any) -> Proc:
    """The fake SGLang backend (`FakeBackendConfig(**config)`) in its own process."""
    port = free_port()
    log = tmp / f"fake-{port}.log"
    p, _ = _start([sys.executable, "-c", _FAKE, json.dumps(config), str(port)], "listening on", log)
    return Proc(p, f"http://127.0.0.1:{port}", log)


def start_proxy(
    tmp: Path,
    backend: str,
    tokenizer: str,
    *args: str,
    db: str | None = None,
    launcher: list[str] | None = None,
) -> Proc:
    """`polar-mitm proxy` in its own process; its CA is tmp/certs. `launcher` runs the CLI
    instead of `python -m polar_mitm` (a bench's wrapper that watches the process from inside)."""
    port = free_port()
    log = tmp / f"proxy-{port}.log"
    argv = [
        *(launcher or [sys.executable, "-m", "polar_mitm"]),
        "proxy",
        "--listen",
        f"127.0.0.1:{port}",
        "--backend",
        backend,
        "--tokenizer",
        tokenizer,
        "--db",
        db or str(tmp / f"proxy-{port}.sqlite"),
        "--certs",
        str(tmp / "certs"),
        *args,
    ]
    p, _ = _start(argv, "polar-mitm proxy on", log)
    return Proc(p, f"http://127.0.0.1:{port}", log)


def start_mitmdump(tmp: Path, host: str, target: str) -> Proc:
    """Bare mitmdump (all its default addons, quiet) intercepting `host` and forwarding its
    requests to `target` (map_remote), with polar-mitm's settings: lazy upstream connections, no
    upstream certificate lookup; its CA is tmp/certs."""
    port = free_port()
    log = tmp / f"mitmdump-{port}.log"
    argv = [
        str(VENV_BIN / "mitmdump"),
        "--listen-host",
        "127.0.0.1",
        "--listen-port",
        str(port),
        "--set",
        f"confdir={tmp / 'certs'}",
        "--set",
        "connection_strategy=lazy",
        "--set",
        "upstream_cert=false",
        "--map-remote",
        f"|https://{host}|{target}",
    ]
    p, _ = _start(argv, "proxy listening at", log)
    return Proc(p, f"http://127.0.0.1:{port}", log)


_TRIVIAL = """
import sys
from aiohttp import web
reply = open(sys.argv[1], "rb").read()
ctype = sys.argv[3]
async def handle(request):
    await request.read()
    return web.Response(body=reply, content_type=ctype)
app = web.Application(client_max_size=1024**3)
app.router.add_route("*", "/{tail:.*}", handle)
print("trivial server ready", flush=True)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), access_log=None, print=None)
"""


def start_trivial(tmp: Path, reply: bytes, content_type: str = "text/event-stream") -> Proc:
    """An aiohttp server that reads each request's body and answers `reply`."""
    port = free_port()
    body = tmp / f"trivial-{port}.bin"
    body.write_bytes(reply)
    log = tmp / f"trivial-{port}.log"
    p, _ = _start([sys.executable, "-c", _TRIVIAL, str(body), str(port), content_type], "ready", log)
    # The line is printed before run_app binds: wait for the port.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.02)
    return Proc(p, f"http://127.0.0.1:{port}", log)


def ensure_ca(tmp: Path) -> Path:
    """One CA for every proxy of the run (polar-mitm and mitmdump read the same confdir)."""
    from polar_mitm.proxy.certs import ensure_ca as _ensure

    return _ensure(tmp / "certs").cert


def workdir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


def _py_spy() -> str:
    """py-spy beside the interpreter, else the one on PATH (e.g. installed apart from the venv)."""
    here = VENV_BIN / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy") or str(here)


class Profile:
    """`py-spy record` on a process while the `with` block runs; `top()` gives the frames that
    hold the most samples (inclusive), from py-spy's raw (collapsed-stack) output."""

    def __init__(self, pid: int, out: Path, rate: int = 1000, *, gil: bool = False):
        self.pid, self.out, self.rate, self.gil = pid, out, rate, gil
        self.popen: subprocess.Popen | None = None

    def __enter__(self) -> Profile:
        self.popen = subprocess.Popen(
            [
                _py_spy(),
                "record",
                "--pid",
                str(self.pid),
                "--rate",
                str(self.rate),
                "--format",
                "raw",
                "--output",
                str(self.out),
                "--nonblocking",
                # Only the thread holding the GIL: a thread sitting in send() reads as busy otherwise.
                *(["--gil"] if self.gil else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(1.0)  # py-spy attaches
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.popen is not None
        procs.stop(self.popen, 30, sig=signal.SIGINT)

    def top(self, n: int = 30) -> list[tuple[str, float, float]]:
        """(frame, inclusive share, self share) of the n frames with most inclusive samples,
        idle samples (the event loop waiting in select/epoll) left out."""
        inclusive: dict[str, int] = {}
        own: dict[str, int] = {}
        total = 0
        for line in self.out.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            frames = stack.split(";")
            if "select (selectors.py" in frames[-1] or "epoll" in frames[-1]:
                continue
            k = int(count)
            total += k
            for f in set(frames):
                inclusive[f] = inclusive.get(f, 0) + k
            own[frames[-1]] = own.get(frames[-1], 0) + k
        ranked = sorted(inclusive.items(), key=lambda kv: -kv[1])[:n]
        return [(f, c / max(total, 1), own.get(f, 0) / max(total, 1)) for f, c in ranked]

    def print_top(self, n: int = 30) -> None:
        print(f"\npy-spy: busy samples by frame (inclusive %, self %), raw profile {self.out}")
        for frame, inc, own in self.top(n):
            print(f"  {inc * 100:5.1f}% {own * 100:5.1f}%  {frame[:150]}")


_REPLAY = """
import asyncio, json, sys
from aiohttp import web
streams = {int(k): v for k, v in json.load(open(sys.argv[1])).items()}
info = json.load(open(sys.argv[3]))
last = {"body": b""}
async def generate(request):
    last["body"] = await request.read()
    body = json.loads(last["body"])
    reply = streams[body["sampling_params"]["max_new_tokens"]]
    chunks = reply["chunks"]
    if not body.get("stream"):
        return web.Response(body=reply["whole"].encode(), content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for c in chunks:
        await resp.write(b"data: " + c.encode() + b"\\n\\n")
    await resp.write(b"data: [DONE]\\n\\n")
    await resp.write_eof()
    return resp
async def server_info(request):
    return web.json_response(info)
app = web.Application(client_max_size=1024**3)
app.router.add_post("/generate", generate)
for path in ("/model_info", "/get_server_info", "/health"):
    app.router.add_get(path, server_info)
app.router.add_get("/_replay/last", lambda request: web.Response(body=last["body"]))
print("replay server ready", flush=True)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), access_log=None, print=None)
"""


def start_replay(tmp: Path, streams: dict[int, dict[str, Any]], info: dict[str, Any]) -> Proc:
    """A stand-in for SGLang's /generate that replays a prepared reply for each max_new_tokens:
    `streams[n]["chunks"]` (JSON texts) streamed as fast as the socket takes them, or
    `streams[n]["whole"]` when the request does not stream. /model_info, /get_server_info and
    /health answer `info`; GET /_replay/last, the last /generate body's bytes. Unlike the fake
    backend, its cost per chunk does not grow with the reply, nor its cost per request with the
    prompt (it reads the body as JSON, nothing more)."""
    port = free_port()
    data = tmp / f"replay-{port}.json"
    data.write_text(json.dumps(streams))
    meta = tmp / f"replay-{port}-info.json"
    meta.write_text(json.dumps(info))
    log = tmp / f"replay-{port}.log"
    p, _ = _start([sys.executable, "-c", _REPLAY, str(data), str(port), str(meta)], "ready", log)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.02)
    return Proc(p, f"http://127.0.0.1:{port}", log)

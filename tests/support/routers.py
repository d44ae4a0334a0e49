"""SGLang's real router (`sglang-router` from PyPI, a Rust binary in a wheel) on loopback, for the
tests and benches that put polar-mitm behind it.

Its workers are fake engines started with `--model-path` set to their local tokenizer
directory: the router loads a worker's tokenizer from its model path, and a hub name would make
it reach out to huggingface.co.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from polar_mitm import procs
from tests.support.harness import free_port
from tests.support.helpers import wait_until


def require_router() -> None:
    pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install sglang-router)")


class Router:
    """`python -m sglang_router.launch_router` on a free loopback port, with no worker at first
    (`add` registers one, as `POST /workers` does)."""

    def __init__(self, policy: str = "manual", *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--policy",
                policy,
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
                "--log-level",
                "warn",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

        def up() -> bool:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    return True
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"router exited: {self.proc.stderr.read().decode()[-2000:]}") from None
                return False

        wait_until(up, timeout=30, interval=0.1, message="the router to start")

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def add(self, worker_url: str, wait: bool = True) -> None:
        req = urllib.request.Request(
            self.url + "/workers",
            data=json.dumps({"url": worker_url}).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10):
            pass
        if wait:
            wait_until(
                lambda: (
                    worker_url in [w["url"] for w in self.get("/workers")["workers"] if w.get("is_healthy")]
                ),
                timeout=20,
                interval=0.1,
                message=f"the router to take worker {worker_url}",
            )

    def stop(self) -> None:
        procs.stop(self.proc, 10)

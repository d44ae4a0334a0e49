"""Helpers for end-to-end tests that drive real harness binaries through `polar-mitm run`."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from polar_mitm import procs
from polar_mitm.cache import cache_dir
from polar_mitm.store.reader import read_turns

POLAR = [sys.executable, "-m", "polar_mitm"]
# Where scripts/install.sh links the commands of the Python harnesses (each in its own virtualenv).
PY_HARNESS_BIN = cache_dir() / "bin"
# The fake's script for Claude Code with a subagent: asked to "begin", the main agent calls its
# `Agent` tool; the subagent (its first user message is the call's prompt) reports; the main agent,
# given the report, ends. Pass it as `--script`, or as the fake's `script` (tests/e2e/
# test_claude_code_structure.py, the TRL step in tests/processes/test_trainers.py).
CLAUDE_SUBAGENT_SCRIPT = [
    # The main agent, once the subagent has reported back through the Agent tool's result.
    {"match": "SUBAGENT-REPORT", "text": "Main agent done."},
    # The subagent's own conversation: its first user message is the Agent call's prompt.
    {"match": "SUBAGENT-TASK", "text": "SUBAGENT-REPORT: the check passed."},
    {
        "match": "[Bb]egin",
        "tool_call": {
            "name": "Agent",
            "arguments": {
                "description": "Run the check",
                "prompt": "SUBAGENT-TASK: check the repository and report",
                "subagent_type": "general-purpose",
            },
        },
    },
]


def free_port() -> int:
    """A loopback port nothing listens on now. Only for a port that must stay unused (to be
    refused) or a server that cannot bind port 0 and say what it got (a third-party binary):
    another process may take it before the server binds it. Our own servers bind port 0 and
    print their address; read it with `printed_url`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def printed_url(line: str) -> str:
    """The `http://HOST:PORT` a server started on port 0 printed once it listened (`polar-mitm
    proxy on …`, `… rollout server on …`); fails the test naming the line where there is none."""
    m = re.search(r"http://(\[[^\]]+\]|[^\s/:]+):(\d+)", line)
    assert m is not None and m[2] != "0", f"no bound address in {line!r}"
    return m[0]


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _path_with_harnesses() -> str:
    return os.pathsep.join([str(PY_HARNESS_BIN), os.environ.get("PATH", os.defpath)])


def require_binary(name: str) -> str:
    path = shutil.which(name, path=_path_with_harnesses())
    if path is None:
        pytest.fail(f"{name} is not installed; scripts/install.sh installs it (from npm or PyPI)")
    return path


class FakeBackend:
    """`polar-mitm fake-backend` in a subprocess on loopback. It binds port 0 and the test reads the
    port it got from the line it prints once listening (a port picked here and bound there could
    be taken in between)."""

    def __init__(self, tokenizer_dir: Path, *extra: str):
        self.proc = subprocess.Popen(
            [
                *POLAR,
                "fake-backend",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--tokenizer",
                str(tokenizer_dir),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output = Lines(self.proc.stdout)  # drained by a thread, so the pipe never fills
        try:
            line = self.output.until("polar-mitm fake backend", timeout=60)
        except AssertionError as e:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"fake backend did not start: {e}") from None
        self.url = printed_url(line)
        self.port = port_of(self.url)

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        procs.stop(self.proc, 10)


class Lines:
    """The lines a process writes to a pipe, read by a thread (which keeps the pipe drained), so a
    test can wait for one with a timeout instead of blocking on a process that never writes it."""

    def __init__(self, pipe):
        self._queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def next(self, timeout: float = 30) -> str:
        try:
            line = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line within {timeout}s; so far: {self.seen}") from None
        if line is None:
            raise AssertionError(f"the process closed its output; it wrote: {self.seen}")
        self.seen.append(line)
        return line

    def wait_for_first(self, timeout: float) -> None:
        """Wait until at least one line came, leaving it to be read."""
        deadline = time.monotonic() + timeout
        while not self.seen and not self._queue.qsize():
            if time.monotonic() > deadline:
                raise AssertionError(f"no line within {timeout}s")
            time.sleep(0.05)

    def until(self, startswith: str, timeout: float = 30) -> str:
        """The first line (from here on) that starts with `startswith`."""
        deadline = time.monotonic() + timeout
        while not (line := self.next(max(deadline - time.monotonic(), 0.01))).startswith(startswith):
            pass
        return line


def harness_env(home: Path) -> dict[str, str]:
    """A clean environment: a fresh HOME, no real provider credentials."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY") and "PROXY" not in k.upper()}
    env["HOME"] = str(home)
    env["XDG_CONFIG_HOME"] = str(home / ".config")
    env["PATH"] = _path_with_harnesses()
    env["CI"] = "1"
    home.mkdir(parents=True, exist_ok=True)
    return env


def polar_run(
    args: list[str], cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 240, stdin=None
):
    """`polar-mitm run ARGS -- CMD`; pass stdin=subprocess.DEVNULL for harnesses that read a piped
    stdin to its end before starting (Pi, OpenCode)."""
    return subprocess.run(
        [*POLAR, "run", *args, "--", *cmd],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=stdin,
    )


def main_turns(db: Path):
    return [t for t in read_turns(db) if t.tag is None]


def assert_turns_match_backend(backend: FakeBackend, db: Path) -> None:
    """Every stored turn's ids and logprobs are exactly what the backend returns for its prompt."""
    con = sqlite3.connect(db)
    for t in read_turns(db):
        row = con.execute("SELECT request FROM turns WHERE id = ?", (t.id,)).fetchone()
        assert row is not None
        bodies = [
            r["body"] for r in backend.get("/_fake/requests")["requests"] if r.get("path") == "/generate"
        ]
        seen = [b for b in bodies if isinstance(b, dict) and b.get("input_ids") == t.prompt_ids]
        assert seen, f"backend never received the prompt of {t.id}"
        again = backend.post(
            "/generate",
            {
                "input_ids": t.prompt_ids,
                "sampling_params": seen[-1].get("sampling_params", {}),
                "return_logprob": True,
            },
        )
        assert again["output_ids"] == t.output_ids
        assert [lp[0] for lp in again["meta_info"]["output_token_logprobs"]] == t.output_logprobs


@dataclass
class ToolTask:
    """What `run_tool_task` saw: the run, its workdir and store, its two main turns, every turn
    with its raw request and reply by id, and the one tool call the first turn made."""

    result: subprocess.CompletedProcess
    work: Path
    db: Path
    t1: Any
    t2: Any
    raw: dict[str, Any]
    call: dict[str, Any]


def run_tool_task(
    recipe: str,
    backend: FakeBackend,
    tokenizer: Path,
    tmp_path: Path,
    session: str,
    *,
    style: str,
    host: str,
    env: dict[str, str] | None = None,
    command: list[str] | None = None,
) -> ToolTask:
    """The recipe's headless command on "Create out.txt containing hi" through `polar-mitm run`
    against the fake's default script, and what every such test asserts: exit 0, the file made
    by the harness's shell tool, two main turns in `style` (a tool call, then the answer), the
    second's prompt extending the first's prompt + sampled ids, and every turn's ids and logprobs
    exactly the backend's; the session stored under the recipe's name with exit code 0, and every
    turn sent to `host`. The rest is the caller's to check. `command` replaces the headless
    command's arguments (another model of the harness's settings, say); "{instruction}" in it is
    the task."""
    from polar_mitm import recipes

    work, db = tmp_path / "work", tmp_path / "runs.sqlite"
    work.mkdir()
    r = polar_run(
        ["--backend", backend.url, "--tokenizer", str(tokenizer), "--db", str(db), "--session", session],
        recipes.get(recipe).headless_command("Create out.txt containing hi", command),
        cwd=work,
        env=env if env is not None else harness_env(tmp_path / "home"),
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (work / "out.txt").read_text() == "hi\n"  # the harness ran the shell tool call
    t1, t2 = main_turns(db)
    assert t1.style == style and t1.finish_reason == "tool_calls" and t2.finish_reason == "stop"
    raw = {t.id: t for t in read_turns(db, with_raw=True)}
    [call] = json.loads(raw[t1.id].response)["tool_calls"]
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert_turns_match_backend(backend, db)
    con = sqlite3.connect(db)
    assert con.execute("SELECT harness, exit_code FROM sessions").fetchone() == (recipe, 0)
    assert {h for (h,) in con.execute("SELECT DISTINCT host FROM turns")} == {host}
    return ToolTask(r, work, db, t1, t2, raw, call)


@contextmanager
def _proxy(backend_url: str, tokenizer: Path, db: Path, certs: Path, *args: str, listen: str):
    """`polar-mitm proxy` in its own process; yields (proc, its stderr's Lines), and stops it with
    SIGINT as a user's Ctrl-C would (killed after 30 s, and then the test fails)."""
    import signal

    proc = subprocess.Popen(
        [*POLAR, "proxy", "--listen", listen, "--backend", backend_url, "--tokenizer", str(tokenizer),
         "--db", str(db), "--certs", str(certs), *args],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        yield proc, Lines(proc.stderr)
    except BaseException:
        procs.stop(proc, 30, sig=signal.SIGINT)  # killed past that: never left running
        raise
    code = procs.stop(proc, 30, sig=signal.SIGINT)
    assert code != -signal.SIGKILL, "polar-mitm proxy did not stop within 30 s of its SIGINT"


@contextmanager
def shared_proxy(backend: FakeBackend, tokenizer: Path, db: Path, certs: Path, *args: str) -> Iterator[Lines]:
    """`polar-mitm proxy` (README's shared proxy) in its own process, with `args`; yields the lines
    it prints."""
    with _proxy(backend.url, tokenizer, db, certs, *args, listen=f"127.0.0.1:{free_port()}") as (_, lines):
        # Its first line once it listens, as proxy_process waits for it: a start (its preflight,
        # N worker processes) takes seconds, many more on a loaded machine.
        lines.wait_for_first(timeout=90)
        yield lines


@contextmanager
def proxy_process(backend_url: str, tokenizer: Path, certs: Path, db: Path, *args: str):
    """`polar-mitm proxy` in front of `backend_url` at the default liveness settings, streaming
    from the engine; yields (proc, an httpx client through it, its stderr's Lines)."""
    import httpx

    with _proxy(
        backend_url, tokenizer, db, certs, "--backend-stream", "stream", *args, listen="127.0.0.1:0"
    ) as (proc, err):
        port = port_of(printed_url(err.until("polar-mitm proxy on", timeout=60)))
        client = httpx.Client(
            proxy=f"http://s:x@127.0.0.1:{port}", verify=str(certs / "mitmproxy-ca-cert.pem"), timeout=120
        )
        with client:
            yield proc, client, err


def claude_in_shell(exports: str, tmp_path: Path) -> None:
    """Claude Code run from a pasted `export` line (`harness_in_shell`)."""
    harness_in_shell(exports, "claude -p 'Create out.txt containing hi' --allowedTools Bash", tmp_path)


def harness_in_shell(exports: str, command: str, tmp_path: Path) -> None:
    """README's way of using a long-lived proxy: a harness's `export` line pasted into a shell and
    the harness run there; it must run its shell tool call and print the fake's final answer."""
    work = tmp_path / "work"
    work.mkdir()
    r = subprocess.run(
        ["bash", "-c", f"{exports}; {command}"],
        cwd=work,
        env=harness_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (work / "out.txt").read_text() == "hi\n"
    assert "Done. The command finished." in r.stdout


def assert_two_spliced_turns(backend: FakeBackend, db: Path, session: str) -> None:
    """Claude Code's tool call and answer: two main turns of `session`, the second's prompt
    beginning with the first's prompt and sampled ids, every id and logprob the backend's."""
    turns = main_turns(db)
    assert len(turns) == 2 and {t.session_id for t in turns} == {session}
    t1, t2 = turns
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert_turns_match_backend(backend, db)

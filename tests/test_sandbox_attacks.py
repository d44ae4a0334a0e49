"""Attacks on a Docker rollout sandbox, made from inside it as a trained agent would make them.

The "harness" is a probe script (python3, run through `--harness-cmd` by the real pipeline in a
real container) that tries what issue 22 lists: direct connections to a host listener, to the
policy backend and to the rollout service; the proxy under another session's name or with a
made-up credential; a CONNECT through the proxy to a host service; sniffing `lo` with an
AF_PACKET socket; symlinks planted where the host writes; a process left behind (after its exit
and after an agent timeout, in an image without `kill`). It prints what worked as JSON; the tests
assert that none of it did, and that the probe still reached its model through the proxy (a real
turn is recorded in its own session).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path

import pytest

from polar_mitm.rollout.pipeline import Pipeline, RolloutOptions
from polar_mitm.tasks.model import EvaluatorSpec, Task

pytestmark = pytest.mark.docker

IMAGE = "polar-mitm/rollout-base:bookworm"
NOKILL_IMAGE = "polar-mitm/test-nokill:1"
VICTIM = "s_victim000000000"

PROBE = r"""
import base64, json, os, socket, ssl, subprocess, sys, time, urllib.request

E = os.environ
out = {}

def attempt(name, fn):
    try:
        out[name] = "ok: " + str(fn())[:200]
    except Exception as e:
        out[name] = "failed: " + f"{e.__class__.__name__}: {e}"[:200]

def tcp(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=2)
    s.settimeout(2)
    data = s.recv(16)
    s.close()
    return data

def http_direct(url):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    return opener.open(url, timeout=3).read()[:60]

def model_call(proxy, text):
    ctx = ssl.create_default_context(cafile=E["SSL_CERT_FILE"])
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({"https": proxy, "http": proxy}),
        urllib.request.HTTPSHandler(context=ctx),
    )
    body = json.dumps({"model": "claude-x", "max_tokens": 16,
                       "messages": [{"role": "user", "content": text}]}).encode()
    req = urllib.request.Request("https://api.anthropic.com/v1/messages", data=body,
                                 headers={"content-type": "application/json", "x-api-key": "k",
                                          "anthropic-version": "2023-06-01"})
    return opener.open(req, timeout=20).status

def via_proxy(proxy, request_line):
    # One request head to the proxy with the sandbox's own credentials: its status line.
    creds, hostport = proxy.split("://", 1)[1].rsplit("@", 1)
    host, port = hostport.rstrip("/").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    auth = base64.b64encode(creds.encode()).decode()
    s.sendall(f"{request_line}\r\nHost: x\r\nProxy-Authorization: Basic {auth}\r\n\r\n".encode())
    line = s.makefile("rb").readline().decode().strip()
    s.close()
    if " 200 " not in line + " ":
        raise OSError(line)
    return line

def with_user(url, user, password):
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{user}:{password}@{rest.rsplit('@', 1)[-1]}"

mode = sys.argv[1]
own = E["HTTPS_PROXY"]
own_token = own.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
if mode == "network":
    attempt("host_listener", lambda: tcp(int(E["PROBE_LISTENER"])))
    attempt("backend", lambda: http_direct(f"http://127.0.0.1:{E['PROBE_BACKEND']}/model_info"))
    attempt("service", lambda: http_direct(f"http://127.0.0.1:{E['PROBE_SERVICE']}/health"))
    attempt("proxy_direct", lambda: model_call(
        f"http://{E['PROBE_VICTIM']}:{own_token}@127.0.0.1:{E['PROBE_PROXY']}", "direct"))
    attempt("victim_name", lambda: model_call(with_user(own, E["PROBE_VICTIM"], own_token), "victim"))
    attempt("made_up_token", lambda: model_call(with_user(own, E["PROBE_VICTIM"], "made-up"), "madeup"))
    attempt("connect_host_listener", lambda: via_proxy(own, f"CONNECT 127.0.0.1:{E['PROBE_LISTENER']} HTTP/1.1"))
    attempt("get_host_listener", lambda: via_proxy(own, f"GET http://127.0.0.1:{E['PROBE_LISTENER']}/ HTTP/1.1"))
    attempt("get_backend", lambda: via_proxy(own, f"GET http://localhost:{E['PROBE_BACKEND']}/model_info HTTP/1.1"))
    attempt("af_packet", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3)).bind(("lo", 0)))
    attempt("own_model", lambda: model_call(own, "own"))
elif mode == "links":
    for d in ("/opt/polar-mitm/session", E["HOME"], os.getcwd(), "/opt/polar-mitm"):
        for name in ("harness.log", "out.log"):
            attempt(f"symlink {d}/{name}", lambda: os.symlink(E["PROBE_TARGET"], f"{d}/{name}"))
    attempt("own_model", lambda: model_call(own, "own"))
elif mode in ("leave", "overrun"):
    subprocess.Popen(["setsid", "sleep", E["PROBE_SLEEP"]], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(0.3)
print("PROBE " + json.dumps(out), flush=True)
if mode == "overrun":
    time.sleep(300)
"""


@pytest.fixture(scope="module")
def docker_client():
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env()
        client.images.get(IMAGE)
    except Exception as e:
        pytest.fail(f"Docker with the test image {IMAGE} is needed: run `bash scripts/docker.sh` ({e})")
    return client


@pytest.fixture(scope="module")
def nokill_image(docker_client, tmp_path_factory) -> str:
    """The test image without `kill` (as a debootstrap minbase image is)."""
    ctx = tmp_path_factory.mktemp("nokill")
    (ctx / "Dockerfile").write_text(f"FROM {IMAGE}\nRUN rm -f /bin/kill /usr/bin/kill\n")
    docker_client.images.build(path=str(ctx), tag=NOKILL_IMAGE, rm=True, pull=False)
    return NOKILL_IMAGE


async def listener() -> tuple[asyncio.Server, int]:
    """A host service on 127.0.0.1 that greets whoever connects."""

    async def greet(reader, writer):
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-length: 5\r\n\r\nhello")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(greet, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def probe_output(work_dir: Path, session_id: str) -> dict:
    log = (work_dir / session_id / "harness.log").read_text()
    line = next(x for x in log.splitlines() if x.startswith("PROBE "))
    return json.loads(line[6:])


def turns_by_session(db: str) -> dict[str, int]:
    con = sqlite3.connect(db)
    return dict(con.execute("SELECT session_id, COUNT(*) FROM turns GROUP BY session_id").fetchall())


async def run_probe(stack, tmp_path, mode: str, *, image: str = IMAGE, env=None, watch=None, **task_kw):
    """One sample of a task whose harness is the probe, through the real pipeline and runtime."""
    from polar_mitm.runtime.docker import DockerRuntime

    task = Task(
        id=f"probe-{mode}",
        instruction="probe",
        image=image,
        evaluator=EvaluatorSpec(kind="command", command="sleep 6"),
        **task_kw,
    )
    opts = RolloutOptions(
        harness="claude-code",
        harness_cmd=["python3", "-c", PROBE, mode, "{instruction}"],
        runtime="docker",
        env=env or {},
        keep_workdirs=True,
        retries=0,
    )
    work = tmp_path / "work"
    p = Pipeline(opts, stack.proxy, DockerRuntime(), work_dir=work, on_change=watch)
    result = await p.run([task])
    [sample] = result.samples
    return p, sample, work


async def test_a_sandbox_reaches_its_model_and_nothing_else(make_stack, tmp_path, docker_client):
    from polar_mitm.service.server import RolloutServer

    stack = await make_stack(token="rollout-token")
    await stack.proxy.store.ensure_session(VICTIM)
    server, port = await listener()
    service = RolloutServer(tmp_path / "service.sqlite")
    service_port = await service.start()
    backend_port = int(stack.backend_url.rsplit(":", 1)[1])
    try:
        env = {
            "PROBE_LISTENER": str(port),
            "PROBE_BACKEND": str(backend_port),
            "PROBE_SERVICE": str(service_port),
            "PROBE_PROXY": str(stack.proxy.port),
            "PROBE_VICTIM": VICTIM,
        }
        _, sample, work = await run_probe(stack, tmp_path, "network", env=env)
    finally:
        server.close()
        await service.stop()
    got = probe_output(work, sample.session_id)
    for attack in ("host_listener", "backend", "service", "proxy_direct", "af_packet"):
        assert got[attack].startswith("failed"), (attack, got[attack])
    # Through its own channel the proxy refuses a host service (even with internet allowed) ...
    for attack in ("connect_host_listener", "get_host_listener", "get_backend"):
        assert got[attack].startswith("failed") and " 403 " in got[attack], (attack, got[attack])
    # ... and whatever name or credential the sandbox sends, its turns are its own.
    assert got["own_model"] == "ok: 200"
    turns = turns_by_session(stack.db)
    assert VICTIM not in turns, turns
    assert turns.get(sample.session_id, 0) >= 1, turns
    assert set(turns) <= {sample.session_id}, turns


async def test_the_host_never_writes_through_a_planted_link(make_stack, tmp_path, docker_client):
    stack = await make_stack(token="rollout-token")
    target = tmp_path / "host-file"
    target.write_text("untouched\n")
    target.chmod(0o666)
    _, sample, work = await run_probe(stack, tmp_path, "links", env={"PROBE_TARGET": str(target)})
    assert target.read_text() == "untouched\n"
    got = probe_output(work, sample.session_id)
    assert got["own_model"] == "ok: 200"
    assert not (work / sample.session_id / "harness.log").is_symlink()


def processes(docker_client, name: str) -> list[str]:
    """The command lines of a container's processes, from the host (`docker top`); none once it
    is stopped or removed."""
    import docker.errors

    try:
        c = docker_client.containers.get(name)
        if c.status != "running":
            return []
        return [" ".join(p[-1:]) for p in c.top().get("Processes") or []]
    except docker.errors.NotFound:
        return []
    except docker.errors.APIError as e:  # stopped meanwhile
        if "is not running" in str(e):
            return []
        raise


@pytest.mark.parametrize("mode", ["leave", "overrun"])
async def test_nothing_the_harness_started_outlives_it(
    make_stack, tmp_path, docker_client, nokill_image, mode
):
    """A `setsid sleep` left behind, at the harness's exit or when it overruns its time, is gone
    within 5 s, in an image without `kill`. Checked from the host while the sample is scored."""
    stack = await make_stack(token="rollout-token")
    seconds = "1234" if mode == "leave" else "1235"
    seen: dict[str, float] = {}

    def watch(p: Pipeline) -> None:
        for j in p.jobs:
            if j.stage == "scoring" and "scoring" not in seen:
                seen["scoring"] = time.monotonic()
                seen["name"] = f"polar-{j.session_id}"  # type: ignore[assignment]

    async def check_later() -> list[str]:
        while "scoring" not in seen:
            await asyncio.sleep(0.05)
        await asyncio.sleep(max(0.0, seen["scoring"] + 4.5 - time.monotonic()))
        return await asyncio.to_thread(processes, docker_client, seen["name"])

    checker = asyncio.create_task(check_later())
    kw = {"agent_timeout_sec": 2} if mode == "overrun" else {}
    _, sample, _ = await run_probe(
        stack, tmp_path, mode, image=nokill_image, env={"PROBE_SLEEP": seconds}, watch=watch, **kw
    )
    left = await asyncio.wait_for(checker, 30)
    assert sample.status == ("agent_timeout" if mode == "overrun" else "completed")
    assert not [p for p in left if f"sleep {seconds}" in p], left

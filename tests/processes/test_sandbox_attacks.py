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
from polar_mitm.sandbox.tempdir import TempdirRuntime
from polar_mitm.tasks.model import EvaluatorSpec, Task
from tests.support.helpers import wait_until_async

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
    out["uid"] = os.getuid()
    out["caps"] = [x.split()[1] for x in open("/proc/self/status") if x.startswith(("CapEff", "CapPrm"))]
    attempt("write_usr_bin", lambda: open("/usr/bin/python3", "ab").close())
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


async def run_probe(
    stack, tmp_path, mode: str, *, image: str = IMAGE, env=None, watch=None, runtime=None, **task_kw
):
    """One sample of a task whose harness is the probe, through the real pipeline and runtime
    (Docker unless given)."""
    from polar_mitm.sandbox.docker import DockerRuntime

    runtime = runtime or DockerRuntime()
    task = Task(
        id=f"probe-{mode}",
        instruction="probe",
        image=image,
        evaluator=EvaluatorSpec(kind="command", command="sleep 5"),
        **task_kw,
    )
    opts = RolloutOptions(
        harness="claude-code",
        harness_cmd=["python3", "-c", PROBE, mode, "{instruction}"],
        runtime=runtime.name,
        env=env or {},
        keep_workdirs=True,
        retries=0,
        allow_unenforced_limits=True,  # (Apptainer without cgroups here: what is probed is the network)
    )
    work = tmp_path / "work"
    p = Pipeline(opts, stack.proxy, runtime, work_dir=work, on_change=watch)
    result = await p.run([task])
    [sample] = result.samples
    return p, sample, work


@pytest.fixture(params=["docker", "apptainer"])
def probe_runtime(request, docker_client, tmp_path):
    """The probe's sandbox: Docker, and Apptainer (the real binary, as root)."""
    from polar_mitm.sandbox.docker import DockerRuntime

    if request.param == "docker":
        return DockerRuntime()
    from polar_mitm.sandbox.apptainer import ApptainerRuntime

    return ApptainerRuntime(binary=request.getfixturevalue("apptainer_binary"), registry_dir=tmp_path / "reg")


@pytest.mark.docker
async def test_a_sandbox_reaches_its_model_and_nothing_else(make_stack, tmp_path, probe_runtime):
    from polar_mitm.service.config import ServerConfig
    from polar_mitm.service.server import RolloutServer

    stack = await make_stack(token="rollout-token")
    await stack.proxy.store.ensure_session(VICTIM)
    server, port = await listener()
    service = RolloutServer(ServerConfig(db=tmp_path / "service.sqlite"))
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
        _, sample, work = await run_probe(stack, tmp_path, "network", env=env, runtime=probe_runtime)
    finally:
        server.close()
        await service.stop()
    got = probe_output(work, sample.session_id)
    for attack in ("host_listener", "backend", "service", "proxy_direct", "af_packet", "write_usr_bin"):
        assert got[attack].startswith("failed"), (attack, got[attack])
    # Through its own channel the proxy refuses a host service (even with internet allowed) ...
    for attack in ("connect_host_listener", "get_host_listener", "get_backend"):
        assert got[attack].startswith("failed") and " 403 " in got[attack], (attack, got[attack])
    # ... and whatever name or credential the sandbox sends, its turns are its own.
    assert got["own_model"] == "ok: 200"
    # An unprivileged user with no capability at all (effective and permitted).
    assert got["uid"] == 1000 and got["caps"] == ["0000000000000000"] * 2, got
    turns = turns_by_session(stack.db)
    assert VICTIM not in turns, turns
    assert turns.get(sample.session_id, 0) >= 1, turns
    assert set(turns) <= {sample.session_id}, turns


@pytest.mark.docker
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


@pytest.mark.docker
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


TAKE = r"""
import os, sys

if sys.argv[1] == "memory":
    held = []
    for i in range(64):  # 640 MB, every page touched
        held.append(bytearray(os.urandom(1)) * (10 << 20))
    open("survived", "w").write("all of it")
elif sys.argv[1] in ("tmp", "home"):
    written = 0
    try:
        with open("/tmp/fill" if sys.argv[1] == "tmp" else os.path.expanduser("~/fill"), "wb") as f:
            for i in range(96):
                f.write(b"x" * (1 << 20))
                f.flush()
                written += 1
        note = f"wrote all {written} MiB"
    except OSError as e:
        note = f"refused after {written} MiB: {e}"
    open("tmp.txt", "w").write(note)
else:
    open("survived", "w").write("ok")
"""


@pytest.mark.docker
async def test_a_task_without_limits_takes_no_more_than_the_defaults(make_stack, tmp_path, docker_client):
    """Tasks that name no memory, CPUs or disk: one allocates 640 MB, one writes 96 MiB to /tmp,
    one 96 MiB to $HOME, one is a neighbour that does its work. With the rollout's defaults (here
    --memory 256, --tmp-size 32, --home-size 32) the first is OOM-killed inside its own limit, the
    writes are refused past 32 MiB, and the rollout goes on: the neighbour completes with its
    reward. Before, a task without limits ran with none (Memory=0): all 640 MB were taken and all
    96 MiB written (to $HOME, a host directory: the host's disk)."""
    from polar_mitm.sandbox.docker import DockerRuntime

    stack = await make_stack()
    tasks = [
        Task(id=mode, instruction=mode, image=IMAGE, workdir="/app",
             evaluator=EvaluatorSpec(kind="command", command=check))
        for mode, check in (("memory", "[ -f survived ]"), ("tmp", "grep -q '^refused after 3[0-2] MiB' tmp.txt"),
                            ("home", "grep -q '^refused after 3[0-2] MiB' tmp.txt"), ("neighbour", "[ -f survived ]"))
    ]  # fmt: skip
    opts = RolloutOptions(
        harness="claude-code",
        harness_cmd=["python3", "-c", TAKE, "{instruction}"],
        runtime="docker",
        retries=0,
        memory=256,
        tmp_size=32,
        home_size=32,
        keep_workdirs=True,
    )
    p = Pipeline(opts, stack.proxy, DockerRuntime(), work_dir=tmp_path / "work")
    result = await p.run(tasks)
    got = {s.task_id: (s.status, s.reward) for s in result.samples}
    assert got == {
        "memory": ("completed", 0.0),
        "tmp": ("completed", 1.0),
        "home": ("completed", 1.0),
        "neighbour": ("completed", 1.0),
    }, got


# --- without containers: the proxy's identities, the channel's relay, the local runtime ---------


def fetch(proxy_url: str, url: str, cafile: str) -> str:
    import ssl
    import urllib.error
    import urllib.request

    handler = urllib.request.ProxyHandler({"http": proxy_url, "https": proxy_url})
    ctx = ssl.create_default_context(cafile=cafile)
    opener = urllib.request.build_opener(handler, urllib.request.HTTPSHandler(context=ctx))
    try:
        return str(opener.open(url, timeout=10).status)
    except urllib.error.HTTPError as e:
        return str(e.code)
    except OSError as e:
        return f"error {e}"


async def test_a_rollout_proxy_lets_in_only_the_sessions_it_issued(make_stack):
    """Issued mode: each session its own token; another's token, the shared token, a name never
    issued: 407. The same proxy before issued mode let any name in with the shared token."""
    from polar_mitm.proxy.embedded import proxy_url

    stack = await make_stack(token="shared")
    p, cafile = stack.proxy, str(stack.proxy.ca.cert)
    url = "https://api.openai.com/v1/models"

    def as_(session: str, token: str) -> str:
        return fetch(proxy_url("127.0.0.1", p.port, session, token), url, cafile)

    assert await asyncio.to_thread(as_, "made-up", "shared") == "200"  # a shared proxy, as before
    p.serve_issued_only()
    a, b = p.issue_session("s_a"), p.issue_session("s_b")
    assert a != b and p.session_url("s_a") == proxy_url("127.0.0.1", p.port, "s_a", a)
    assert await asyncio.to_thread(as_, "s_a", a) == "200"
    assert "Tunnel connection failed: 407" in await asyncio.to_thread(as_, "s_a", b)
    assert "407" in await asyncio.to_thread(as_, "made-up", "shared")
    assert "407" in await asyncio.to_thread(as_, "s_b", "shared")
    p.revoke_session("s_a")
    assert "407" in await asyncio.to_thread(as_, "s_a", a)


def unverified(proxy_url: str, url: str, body: bytes | None = None, **more: str) -> str:
    """The status of one request through `proxy_url` with a TLS context that checks nothing (as
    the agent's code may make one), headers `more` added, or what stopped it."""
    import ssl
    import urllib.error
    import urllib.request

    handler = urllib.request.ProxyHandler({"http": proxy_url, "https": proxy_url})
    ctx = ssl._create_unverified_context()
    opener = urllib.request.build_opener(handler, urllib.request.HTTPSHandler(context=ctx))
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01", "x-api-key": "k",
               "authorization": "Bearer k", **more}  # fmt: skip
    try:
        return str(opener.open(urllib.request.Request(url, data=body, headers=headers), timeout=20).status)
    except urllib.error.HTTPError as e:
        return str(e.code)
    except OSError as e:
        return f"error {e}"


async def test_a_verifier_reaches_no_model_on_any_path(make_stack):
    """A verifier's session (contained, the model refused, as a rollout makes it) with a TLS context
    that checks nothing: a tunnel the proxy's port hands to the gateway, a tunnel mitmproxy relays
    (bytes after the CONNECT's head), absolute-form plain HTTP, a stub host, an internet address
    with the provider named in Host: every one refused, and no turn stored. Before, the tunnels
    the gateway took got the policy's completions (200)."""
    import socket
    import ssl

    from polar_mitm.proxy.addons.sessions import basic_auth
    from polar_mitm.proxy.embedded import proxy_url

    stack = await make_stack()
    p = stack.proxy
    p.serve_issued_only()
    session = "s_box-verifier"
    await p.store.ensure_session(session)
    token = p.issue_session(session)
    p.egress.contain(session)
    p.egress.deny_model(session)
    url = proxy_url("127.0.0.1", p.port, session, token)
    body = json.dumps(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    chat = json.dumps(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()

    def eager_tunnel() -> str:
        # The CONNECT and the TLS hello in one write: mitmproxy serves it, not the gateway's take.
        raw = socket.create_connection(("127.0.0.1", p.port), timeout=20)
        hello = ssl._create_unverified_context().wrap_bio(
            ssl.MemoryBIO(), ssl.MemoryBIO(), server_hostname="x"
        )
        try:
            hello.do_handshake()
        except ssl.SSLWantReadError:
            pass
        head = (f"CONNECT api.anthropic.com:443 HTTP/1.1\r\nHost: api.anthropic.com:443\r\n"
                f"Proxy-Authorization: {basic_auth(session, token)}\r\n\r\n").encode()  # fmt: skip
        raw.sendall(head + b"\x16\x03\x01\x00\x05hello")
        line = raw.makefile("rb").readline().decode().strip()
        raw.close()
        return line

    got = {
        "taken tunnel": await asyncio.to_thread(
            unverified, url, "https://api.anthropic.com/v1/messages", body
        ),
        "openai tunnel": await asyncio.to_thread(
            unverified, url, "https://api.openai.com/v1/chat/completions", chat
        ),
        "absolute-form": await asyncio.to_thread(
            unverified, url, "http://api.anthropic.com/v1/messages", body
        ),
        "stub host": await asyncio.to_thread(
            unverified, url, "https://statsig.anthropic.com/v1/initialize", b"{}"
        ),
        # An internet address in the URL (what the egress rules check), the provider in Host.
        "address, provider in Host": await asyncio.to_thread(
            unverified, url, "http://93.184.215.14/v1/models", None, Host="api.anthropic.com"
        ),
    }
    eager = await asyncio.to_thread(eager_tunnel)
    assert not any(v.startswith("200") for v in got.values()), got
    assert " 200 " not in eager + " ", eager
    await asyncio.sleep(0.5)
    assert session not in turns_by_session(stack.db)


HUGE = r"""
import base64, socket, sys, threading

port, auth, tunnels, tunnel_mb, plains, plain_mb = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
MB = b"x" * 2**20
statuses = []

def send(head, mb, tls):
    try:
        s = socket.create_connection(("127.0.0.1", int(port)), timeout=60)
        if tls:
            import ssl
            s.sendall(b"CONNECT api.anthropic.com:443 HTTP/1.1\r\nHost: api.anthropic.com:443\r\n"
                      b"Proxy-Authorization: Basic " + auth.encode() + b"\r\n\r\n")
            s.recv(4096)
            s = ssl._create_unverified_context().wrap_socket(s, server_hostname="api.anthropic.com")
        s.sendall(head % (mb * 2**20))
        for _ in range(mb):
            s.sendall(MB)
        statuses.append(s.recv(4096).split(b"\r\n", 1)[0].decode())
    except OSError as e:
        statuses.append(f"{e.__class__.__name__}")

tunnel = b"POST /v1/messages HTTP/1.1\r\nHost: api.anthropic.com\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
plain = (b"POST http://93.184.215.14:9/upload HTTP/1.1\r\nHost: 93.184.215.14:9\r\n"
         b"Proxy-Authorization: Basic " + auth.encode() + b"\r\ncontent-length: %d\r\n\r\n")
threads = [threading.Thread(target=send, args=(tunnel, tunnel_mb, True)) for _ in range(tunnels)]
threads += [threading.Thread(target=send, args=(plain, plain_mb, False)) for _ in range(plains)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("\n".join(sorted(statuses)))
"""


def rss_now_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def test_one_samples_huge_bodies_leave_the_proxy_s_memory_bounded(make_stack):
    """One sandboxed session sends huge request bodies at once, as fast as loopback takes them:
    20 x 30 MB model calls through tunnels the gateway takes, and 2 x 200 MB plain-HTTP uploads
    to an internet address through mitmproxy (bodies it would buffer whole before connecting).
    Before, the proxy held them all: its RSS rose by about a gigabyte. Now each is refused (413,
    naming the cap) once the session's bytes in flight would pass its budget, or streamed, and
    the RSS of the process (the proxy's) rises by under 300 MB."""
    import base64
    import subprocess
    import sys

    stack = await make_stack()
    p = stack.proxy
    p.serve_issued_only()
    session = "s_huge"
    await p.store.ensure_session(session)
    token = p.issue_session(session)
    p.egress.contain(session)
    auth = base64.b64encode(f"{session}:{token}".encode()).decode()
    before = rss_now_mb()
    peak = before

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, rss_now_mb())
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        attack = await asyncio.create_subprocess_exec(
            sys.executable, "-c", HUGE, str(p.port), auth, "20", "30", "2", "200",
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(attack.communicate(), 240)
    finally:
        watcher.cancel()
    statuses = out.decode().splitlines()
    assert len(statuses) == 22, out.decode()[-2000:]
    assert not any(" 200 " in s + " " for s in statuses), statuses
    assert peak - before < 300, (before, peak, statuses)


async def test_a_tunnel_keeps_its_session_whatever_header_it_sends(make_stack):
    """A model call through a tunnel the gateway takes, with the header the routing addon names a
    routed flow's session in (`x-polar-session`) set to another sample's: its turn is stored in
    its own session. Before, the header won over the connection's session."""
    from polar_mitm.proxy.embedded import proxy_url

    stack = await make_stack()
    p = stack.proxy
    p.serve_issued_only()
    for s in ("s_own", "s_other"):
        await p.store.ensure_session(s)
        p.issue_session(s)
    url = proxy_url("127.0.0.1", p.port, "s_own", p.issue_session("s_own"))
    body = json.dumps(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    got = await asyncio.to_thread(
        unverified, url, "https://api.anthropic.com/v1/messages", body, **{"x-polar-session": "s_other"}
    )
    assert got == "200"
    await wait_until_async(lambda: sum(turns_by_session(stack.db).values()) >= 1, message="a stored turn")
    assert turns_by_session(stack.db) == {"s_own": 1}


async def test_a_connection_keeps_the_session_it_opened_with(make_stack):
    """Plain HTTP requests on one kept-alive connection: the second names another session (with
    that session's own token, as a sandbox that learned it would); its turn stays in the first."""
    import http.client

    from polar_mitm.proxy.addons.sessions import basic_auth

    stack = await make_stack(token="shared")
    p = stack.proxy
    p.serve_issued_only()
    for s in ("s_first", "s_other"):
        await p.store.ensure_session(s)
    tokens = {s: p.issue_session(s) for s in ("s_first", "s_other")}
    body = json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})

    def two_requests() -> list[int]:
        conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=30)
        out = []
        for s in ("s_first", "s_other"):
            headers = {"content-type": "application/json", "anthropic-version": "2023-06-01",
                       "x-api-key": "k", "proxy-authorization": basic_auth(s, tokens[s])}  # fmt: skip
            conn.request("POST", "http://api.anthropic.com/v1/messages", body, headers)
            r = conn.getresponse()
            r.read()
            out.append(r.status)
        conn.close()
        return out

    assert await asyncio.to_thread(two_requests) == [200, 200]
    await wait_until_async(lambda: sum(turns_by_session(stack.db).values()) >= 2, message="two stored turns")
    assert turns_by_session(stack.db) == {"s_first": 2}


async def test_the_channel_names_its_sample_whatever_the_sandbox_sends():
    """Each connection's first request head reaches the proxy with the sample's own credentials
    and none of those the sandbox sent; a connection without a head gets a 400."""
    from polar_mitm.proxy.addons.sessions import basic_auth
    from polar_mitm.sandbox.channel import Channel

    heads: list[bytes] = []

    async def record(reader, writer):
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        writer.write(await reader.read(5))  # the tunnel: echoed
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(record, "127.0.0.1", 0)
    channel = await Channel("s_own", "own-token", server.sockets[0].getsockname()[1]).start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(channel.socket_path))
        stolen = basic_auth("s_victim", "stolen")
        writer.write(
            b"CONNECT api.anthropic.com:443 HTTP/1.1\r\nHost: api.anthropic.com:443\r\n"
            + f"Proxy-Authorization: {stolen}\r\nproxy-authorization: {stolen}\r\n\r\nhello".encode()
        )
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(1000), 5)
        writer.close()
        reader, writer = await asyncio.open_unix_connection(str(channel.socket_path))
        writer.write(b"no head at all")
        writer.write_eof()
        refused = await asyncio.wait_for(reader.read(1000), 5)
        writer.close()
    finally:
        await channel.close()
        server.close()
    assert reply == b"HTTP/1.1 200 Connection established\r\n\r\nhello"
    [head] = heads
    assert head.startswith(b"CONNECT api.anthropic.com:443 HTTP/1.1\r\n")
    assert head.lower().count(b"proxy-authorization:") == 1
    assert basic_auth("s_own", "own-token").encode() in head and b"stolen" not in head
    assert refused.startswith(b"HTTP/1.1 400 ")
    assert not channel.socket_path.exists()  # closed: the socket and its directory are gone


async def test_a_local_harness_gets_no_host_secret_and_no_host_write_through_a_link(
    make_stack, tmp_path, monkeypatch
):
    """The local runtime: host variables by allow-list (a secret in the host environment does not
    reach the harness; PATH, the task's env and --env do); --env values are stored redacted; a
    link the harness plants where the host writes its log is not followed."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-value")
    monkeypatch.setenv("POLAR_MITM_SERVICE_TOKEN", "service-token-value")
    stack = await make_stack(token="rollout-token")
    target = tmp_path / "host-file"
    target.write_text("untouched\n")
    script = 'env; ln -s "$TARGET" "$HOME/../harness.log"'
    task = Task(
        id="env", instruction="x", env={"TASK_VAR": "task-value", "TARGET": str(target)},
        evaluator=EvaluatorSpec(kind="command", command="true"),
    )  # fmt: skip
    opts = RolloutOptions(
        harness="claude-code", runtime="local", harness_cmd=["sh", "-c", script, "h", "{instruction}"],
        env={"HF_TOKEN": "hf-secret-value"}, keep_workdirs=True,
    )  # fmt: skip
    work = tmp_path / "work"
    p = Pipeline(opts, stack.proxy, TempdirRuntime(), work_dir=work)
    result = await p.run([task])
    [sample] = result.samples
    assert sample.status == "completed"
    assert target.read_text() == "untouched\n"
    con = sqlite3.connect(stack.db)
    [(config,)] = con.execute("SELECT config FROM rollouts").fetchall()
    assert "hf-secret-value" not in config and json.loads(config)["env"] == {"HF_TOKEN": "[redacted]"}
    # What the harness printed went nowhere (the log was a link it planted); run it again to read it.
    opts.harness_cmd = ["sh", "-c", "env", "h", "{instruction}"]
    p = Pipeline(opts, stack.proxy, TempdirRuntime(), work_dir=work)
    [sample] = (await p.run([task])).samples
    env = dict(
        line.split("=", 1)
        for line in (work / sample.session_id / "harness.log").read_text().splitlines()
        if "=" in line
    )
    assert "AWS_SECRET_ACCESS_KEY" not in env and "POLAR_MITM_SERVICE_TOKEN" not in env
    assert env["TASK_VAR"] == "task-value" and env["HF_TOKEN"] == "hf-secret-value" and env["PATH"]
    assert "rollout-token" not in str(env)  # its own token in HTTPS_PROXY, not the rollout's
    assert (
        env["HTTPS_PROXY"] == stack.proxy.session_url(sample.session_id)
        or sample.session_id in env["HTTPS_PROXY"]
    )


@pytest.mark.docker
@pytest.mark.parametrize("forwarder", ["node", "python3"])
async def test_the_forwarder_inside_relays_to_the_channel(tmp_path, docker_client, certs_dir, forwarder):
    """The forwarder on 127.0.0.1:3128 inside a container without network, with our node or the
    image's python3, carries a request to the host's relay and its answer back."""
    import shutil

    from polar_mitm.proxy.addons.sessions import basic_auth
    from polar_mitm.proxy.certs import ensure_ca
    from polar_mitm.sandbox.base import HarnessMount, SandboxSpec
    from polar_mitm.sandbox.channel import Channel
    from polar_mitm.sandbox.docker import DockerRuntime

    heads: list[bytes] = []

    async def answer(reader, writer):
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nhi")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    channel = await Channel("s_fwd", "tok", server.sockets[0].getsockname()[1]).start()
    node = shutil.which("node")
    harness = None
    if forwarder == "node":
        if node is None:
            pytest.skip("no node on this host")
        harness = HarnessMount(modules=tmp_path, bin=tmp_path, node=Path(node).resolve())
    spec = SandboxSpec(
        name=f"polar-fwd-{forwarder}-{time.time_ns()}", session_dir=tmp_path / "s", ca=ensure_ca(certs_dir),
        harness=harness, channel=channel.socket_path, labels={"polar-mitm.rollout": "fwd-test"},
    )  # fmt: skip
    rt = DockerRuntime()
    sb = await rt.start(Task(id="fwd", instruction="x", image=IMAGE), spec)
    try:
        await channel.wait_ready(10)  # the forwarder said it listens
        client = (
            "import socket; s = socket.create_connection(('127.0.0.1', 3128)); "
            "s.sendall(b'GET http://example.com/ HTTP/1.1\\r\\nHost: example.com\\r\\n\\r\\n'); "
            "print(s.makefile('rb').read().decode())"
        )
        r = await sb.exec(["python3", "-c", client], timeout=20)
        top = await asyncio.to_thread(sb.container.top)
    finally:
        await sb.stop()
        await channel.close()
        server.close()
    assert r.exit_code == 0 and r.output.strip().endswith("hi"), r.output
    assert heads and basic_auth("s_fwd", "tok").encode() in heads[0]
    forwarders = [p[-1] for p in top["Processes"] if "forward." in p[-1]]
    assert forwarders and ("forward.js" if forwarder == "node" else "forward.py") in forwarders[0]


@pytest.mark.docker
@pytest.mark.parametrize("purpose", ["agent", "verifier", "verifier-internet"])
async def test_containers_run_with_least_privilege(tmp_path, docker_client, certs_dir, purpose):
    """What the daemon was asked for: no network, every capability dropped but root's five,
    no-new-privileges, a pids limit, the task's memory and CPUs; every mount of ours read-only (the
    harness's HOME a tmpfs). A verifier's sandbox: no harness, no channel, no HOME; one whose task lets
    it reach the internet: its channel's socket and the forwarder, read-only, and nothing else."""
    internet = purpose == "verifier-internet"
    purpose = "verifier" if internet else purpose
    from polar_mitm.proxy.certs import ensure_ca
    from polar_mitm.sandbox.base import HOME_DIR, PIDS_LIMIT, SandboxSpec
    from polar_mitm.sandbox.channel import Channel
    from polar_mitm.sandbox.docker import ROOT_CAPS, DockerRuntime

    channel = await Channel("s_priv", "tok", 9).start()
    spec = SandboxSpec(
        name=f"polar-priv-{purpose}-{time.time_ns()}", session_dir=tmp_path / "s", ca=ensure_ca(certs_dir),
        channel=channel.socket_path if purpose == "agent" or internet else None, purpose=purpose,
        labels={"polar-mitm.rollout": "priv-test"},
    )  # fmt: skip
    task = Task(id="priv", instruction="x", image=IMAGE, memory_mb=512, cpus=1.5)
    sb = await DockerRuntime().start(task, spec)
    try:
        attrs = await asyncio.to_thread(lambda: docker_client.containers.get(sb.name).attrs)
    finally:
        await sb.stop()
        await channel.close()
    host = attrs["HostConfig"]
    assert host["NetworkMode"] == "none"
    assert host["CapDrop"] == ["ALL"] and sorted(host["CapAdd"]) == sorted(ROOT_CAPS)
    assert "NET_RAW" not in host["CapAdd"]
    if purpose == "agent":  # Docker's default seccomp profile
        assert host["SecurityOpt"] == ["no-new-privileges:true"]
    else:  # the verifier's own (sandbox/seccomp.py), and /proc read-only
        from polar_mitm.sandbox.seccomp import verifier_security_opt

        assert host["SecurityOpt"] == ["no-new-privileges:true", verifier_security_opt()]
        assert "/proc" in host["ReadonlyPaths"] and "/proc/sys" in host["ReadonlyPaths"]
    assert host["PidsLimit"] == PIDS_LIMIT
    assert host["Memory"] == 512 * 2**20 and host["NanoCpus"] == 1_500_000_000
    writable = [m["Destination"] for m in attrs["Mounts"] if m["RW"]]
    if purpose == "agent":
        # HOME a tmpfs of --home-size (its files copied in from the sample's `home`, read-only)
        assert writable == [] and sb.proxy_address == ("127.0.0.1", 3128)
        assert host["Tmpfs"][HOME_DIR] == "rw,exec,nosuid,nodev,size=1024m,mode=0755"
        assert any(m["Destination"].endswith("proxy.sock") for m in attrs["Mounts"])
    elif internet:
        assert writable == [] and sb.proxy_address == ("127.0.0.1", 3128) and sb.user is None
        assert sorted(m["Destination"] for m in attrs["Mounts"]) == [
            "/opt/polar-mitm/channel/proxy.sock",
            "/opt/polar-mitm/forwarder",
        ]
    else:
        assert writable == [] and sb.proxy_address is None and sb.user is None
        assert not any(
            "proxy.sock" in m["Destination"] or "forwarder" in m["Destination"] for m in attrs["Mounts"]
        )


@pytest.mark.parametrize(
    "ip,local",
    [
        ("127.0.0.1", True), ("10.1.2.3", True), ("172.17.0.1", True), ("192.168.1.1", True),
        ("169.254.169.254", True), ("0.0.0.0", True), ("::1", True), ("::ffff:127.0.0.1", True),
        ("fd00::1", True), ("fe80::1%eth0", True), ("224.0.0.1", True), ("100.64.0.1", True),
        ("1.1.1.1", False), ("8.8.8.8", False), ("2606:4700:4700::1111", False),
    ],
)  # fmt: skip
def test_host_local_addresses(ip, local):
    from polar_mitm.proxy.addons.egress import host_local

    assert host_local(ip) is local


async def test_egress_refuses_host_addresses_and_pins_the_checked_one():
    """The addon alone (mitmproxy's tflow): a contained session's CONNECT to a name of this
    machine is refused; to a public address it passes, pinned to the address checked; provider
    hosts and other sessions are not touched."""
    from mitmproxy.test import tflow

    from polar_mitm.proxy.addons.egress import Egress

    egress = Egress({"api.anthropic.com"})
    egress.contain("s_box")

    def connect(host: str, session: str = "s_box"):
        f = tflow.tflow()
        f.request.method, f.request.host, f.request.port = "CONNECT", host, 443
        f.metadata["polar_session"] = session
        return f

    local, public, model, other = connect("localhost"), connect("1.1.1.1"), connect("api.anthropic.com"), connect("localhost", "s_free")  # fmt: skip
    for f in (local, public, model, other):
        await egress.http_connect(f)
    assert local.response is not None and local.response.status_code == 403
    assert b"not reachable from this sandbox" in local.response.content
    assert public.response is None and public.request.host == "1.1.1.1"
    assert model.response is None and other.response is None
    egress.release("s_box")
    again = connect("localhost")
    await egress.http_connect(again)
    assert again.response is None


async def test_egress_refuses_a_name_that_does_not_resolve_then_resolves_to_the_host(monkeypatch):
    """The attacker's DNS: the proxy's lookup of the name fails, and only a later one (mitmproxy's,
    when the client sends data through the tunnel) answers 127.0.0.1. Before, the failed lookup let
    the CONNECT through, and the sandbox's request reached a listener on the host's loopback; now
    the name is refused at once. A name that resolves to no address is refused the same way."""
    import socket

    from mitmproxy.test import tflow

    from polar_mitm.proxy.addons.egress import Egress

    lookups: list[str] = []

    async def rebinding(host, port, **kw):
        lookups.append(host)
        if host == "empty.example":
            return []
        if lookups.count(host) == 1:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", rebinding)
    egress = Egress({"api.anthropic.com"})
    egress.contain("s_box")
    flows = {}
    for host in ("rebind.example", "empty.example"):
        f = tflow.tflow()
        f.request.method, f.request.host, f.request.port = "CONNECT", host, 8080
        f.metadata["polar_session"] = "s_box"
        await egress.http_connect(f)
        flows[host] = f
        assert f.response is not None and f.response.status_code == 403, host
        assert f.request.host == host  # nothing pinned: nothing is connected to
    assert b"does not resolve" in flows["rebind.example"].response.content
    assert egress.refused == 2


FLOOD = r"""
import json, os, socket, ssl, sys, time, urllib.request

E = os.environ
def model_call(text):
    ctx = ssl.create_default_context(cafile=E["SSL_CERT_FILE"])
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({"https": E["HTTPS_PROXY"]}), urllib.request.HTTPSHandler(context=ctx))
    body = json.dumps({"model": "claude-x", "max_tokens": 16,
                       "messages": [{"role": "user", "content": text}]}).encode()
    req = urllib.request.Request("https://api.anthropic.com/v1/messages", data=body,
                                 headers={"content-type": "application/json", "x-api-key": "k",
                                          "anthropic-version": "2023-06-01"})
    return opener.open(req, timeout=30).status

if "flood" in sys.argv[1]:
    held, refused = [], 0
    deadline = time.time() + float(E["FLOOD_SECONDS"])
    for i in range(int(E["FLOOD_CONNECTIONS"])):
        try:
            s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
            s.sendall(b"CONNECT api.anthropic.com:443 HTTP/1.1\r\nHost: api.anthropic.com:443\r\n\r\n")
            held.append(s)
        except OSError:
            refused += 1
    while time.time() < deadline:
        time.sleep(0.2)
    print("FLOOD", len(held), refused, flush=True)
else:
    time.sleep(float(E["VICTIM_DELAY"]))  # the flood is under way
    ok = 0
    for i in range(int(E["VICTIM_CALLS"])):
        try:
            ok += model_call(f"call {i}") == 200
        except Exception as e:
            print("CALL FAILED", i, e, flush=True)
    open("calls.txt", "w").write(str(ok))
"""


@pytest.mark.docker
async def test_one_samples_connection_flood_leaves_its_neighbours_whole(make_stack, tmp_path, docker_client):
    """One sandbox opens thousands of idle CONNECTs to its model host through its own channel;
    a second sample, meanwhile, makes its model calls. Before, every one of those connections
    cost the rollout process descriptors until it ran out (here under a 2,048 limit): the
    neighbour's calls failed and its sample with them. Now a channel holds at most MAX_OPEN
    connections open (the rest answered 429 and closed at once): every call of the neighbour is
    answered, it completes with its own reward, and the process stays far from its limit."""
    import os
    import resource

    from polar_mitm.sandbox.channel import MAX_OPEN
    from polar_mitm.sandbox.docker import DockerRuntime

    connections = 5000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    peak = 0

    async def watch_fds():
        nonlocal peak
        while True:
            peak = max(peak, len(os.listdir("/proc/self/fd")))
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch_fds())
    try:
        stack = await make_stack(token="rollout-token")
        calls = 15
        tasks = [
            Task(id="flood", instruction="flood", image=IMAGE, workdir="/app",
                 evaluator=EvaluatorSpec(kind="command", command="true")),
            Task(id="victim", instruction="victim", image=IMAGE, workdir="/app",
                 evaluator=EvaluatorSpec(kind="command", command=f'[ "$(cat calls.txt)" = {calls} ]')),
        ]  # fmt: skip
        opts = RolloutOptions(
            harness="claude-code",
            harness_cmd=["python3", "-c", FLOOD, "{instruction}"],
            runtime="docker",
            env={
                "FLOOD_CONNECTIONS": str(connections),
                "FLOOD_SECONDS": "25",
                "VICTIM_DELAY": "8",
                "VICTIM_CALLS": str(calls),
            },  # fmt: skip
            keep_workdirs=True,
            retries=0,
            init_workers=2,
            run_workers=2,
            postrun_workers=2,
        )
        p = Pipeline(opts, stack.proxy, DockerRuntime(), work_dir=tmp_path / "work")
        result = await p.run(tasks)
    finally:
        watcher.cancel()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    got = {s.task_id: (s.status, s.reward) for s in result.samples}
    victim = next(s for s in result.samples if s.task_id == "victim")
    flood = next(s for s in result.samples if s.task_id == "flood")
    log = (tmp_path / "work" / victim.session_id / "harness.log").read_text()
    assert got == {"flood": ("completed", 1.0), "victim": ("completed", 1.0)}, (got, log[-2000:])
    assert "CALL FAILED" not in log
    assert turns_by_session(stack.db).get(victim.session_id) == calls
    flood_log = (tmp_path / "work" / flood.session_id / "harness.log").read_text()
    held = int(flood_log.split("FLOOD ", 1)[1].split()[0])
    assert held == connections  # the forwarder inside took them all: the flood really happened
    print("peak descriptors", peak)
    assert peak < 700, peak  # far from the 2,048 limit; before, the flood alone went past it
    assert MAX_OPEN <= 64


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.docker
async def test_big_artefacts_are_streamed_and_a_huge_sparse_one_refused_from_its_size(
    make_stack, tmp_path, docker_client
):
    """The agent leaves a 900 MB file in its workdir: it is scored (1.0) with the rollout
    process's memory growing by far less than the file (before: the tar was held whole and copied
    again, 2.2 GB). A sparse 100 GB file is refused as too large from its size, at once, without
    reading it (before: 142 s of reading zeros)."""
    from polar_mitm.sandbox.docker import DockerRuntime

    stack = await make_stack(token="rollout-token")
    make = {
        "big": "dd if=/dev/zero of=big.bin bs=1M count=900 status=none",
        "sparse": "truncate -s 100G big.bin",
    }
    tasks = [
        Task(id=name, instruction=name, image=IMAGE, workdir="/app",
             evaluator=EvaluatorSpec(kind="command", command="test -s big.bin"))
        for name in make
    ]  # fmt: skip
    script = 'case "$1" in big) ' + make["big"] + " ;; sparse) " + make["sparse"] + " ;; esac"
    opts = RolloutOptions(
        harness="claude-code",
        harness_cmd=["sh", "-c", script, "sh", "{instruction}"],
        runtime="docker",
        retries=0,
        postrun_workers=1,
    )
    base, peak = rss_mb(), 0.0

    async def watch():
        nonlocal peak
        while True:
            peak = max(peak, rss_mb())
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        p = Pipeline(opts, stack.proxy, DockerRuntime(), work_dir=tmp_path / "work")
        result = await p.run(tasks)
    finally:
        watcher.cancel()
    got = {s.task_id: s for s in result.samples}
    assert (got["big"].status, got["big"].reward) == ("completed", 1.0), got["big"]
    assert got["sparse"].status == "failed" and "not scored" in (got["sparse"].cause or "")
    assert "by its files' sizes" in got["sparse"].cause
    assert got["sparse"].timings.get("scoring", 0) < 20, got["sparse"].timings
    print(f"rss: {base:.0f} MB before, {peak:.0f} MB at peak")
    assert peak - base < 250, (base, peak)  # the file is 900 MB


@pytest.mark.docker
@pytest.mark.parametrize("init", ["sleep", "forward.py", "forward.js"])
async def test_a_verifiers_init_keeps_what_detached_from_the_tests_in_view(tmp_path, certs_dir, init):
    """Whatever the verifier's init (`sleep`; the forwarder of a verifier that reaches the
    internet, on the image's python3 or our node), a process that detached from the tests and
    exited before they ended is still there when they are sealed: a zombie the init never reaps."""
    import shutil

    from polar_mitm.proxy.certs import ensure_ca
    from polar_mitm.rollout.verdict import run_tests
    from polar_mitm.sandbox.base import SandboxSpec
    from polar_mitm.sandbox.channel import Channel
    from polar_mitm.sandbox.docker import DockerRuntime

    channel = await Channel("s_init", "tok", 9).start() if init != "sleep" else None
    node = Path(shutil.which("node") or "/usr/bin/node").resolve() if init == "forward.js" else None
    spec = SandboxSpec(
        name=f"polar-init-{time.time_ns()}", session_dir=tmp_path / "s", ca=ensure_ca(certs_dir),
        channel=channel.socket_path if channel else None, purpose="verifier", forwarder_node=node,
        labels={"polar-mitm.rollout": "init-test"},
    )  # fmt: skip
    sb = await DockerRuntime().start(Task(id="init", instruction="x", image=IMAGE), spec)
    try:
        if init == "sleep":  # what lets it skip the listing before the tests: nothing but its init
            assert sb.quiet and await sb.processes() == []
        r, left = await run_tests(
            sb,
            ["sh", "-c", "(setsid sh -c 'sleep 0.2' </dev/null >/dev/null 2>&1 &); sleep 1.5"],
            env={},
            timeout=30,
        )
        assert r.exit_code == 0, r.output
        assert [p.state for p in left] == ["Z"], left
    finally:
        await sb.stop()
        if channel is not None:
            await channel.close()

"""A sample's calls to the Docker daemon once its container exists.

`DaemonCalls` speaks the daemon's HTTP API on its local Unix socket itself, with a kept-alive
connection per thread; `SdkCalls` is the same interface through the `docker` SDK, for a daemon
that is not a local socket. `DockerRuntime.calls` picks one; images and a container's config stay
with the SDK (`sandbox/docker.py`).

Why not the SDK everywhere: a rollout sample makes ~50 of these calls, and through the SDK each
cost ~1.3 ms of CPU in requests' machinery (sessions, adapters, urllib3's pool), most of
polar-mitm's own CPU in a rollout. Then `http.client` cost 0.17 ms an inspect, half of it parsing
the reply's headers with the email package; read here by the few rules the daemon's Go server
follows (`_Connection`), 0.07 ms. `bench/bench_docker_calls.py` measures the clients.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any, BinaryIO

CHUNK = 1 << 20  # bytes per read of an archive stream, and per write of one sent
LINE = 65536  # the longest status or header line read


class DaemonRefused(RuntimeError):
    """The daemon answered a call with an error status (a container gone: 404; stopped, paused or
    not running: 409)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}".strip())
        self.status = status


class DaemonClosed(ConnectionError):
    """The daemon closed the connection before it answered: on a kept-alive connection, the request
    never reached it (Go's server closes idle connections)."""


class DaemonCalls:
    """The daemon's calls (create and start; an exec's three: create, start, inspect; a container's
    inspect, kill, wait, start, pause, top, archives in and out, and removal) on its Unix socket,
    a kept-alive connection per thread; an exec's output, a wait and an archive each on a
    connection of their own."""

    def __init__(self, socket_path: str, version: str, timeout: float = 120):
        self.socket_path = socket_path
        self.prefix = f"/v{version}"
        self.timeout = timeout
        self._local = threading.local()

    def run(
        self, container: str, cmd: list[str], env: dict[str, str], workdir: str, user: str = ""
    ) -> tuple[int, bytes]:
        """(exit code, stdout and stderr as written; -1 when the daemon reports no exit code)."""
        made = self._json(
            "POST",
            f"/containers/{container}/exec",
            {
                "User": user,
                "Privileged": False,
                "Tty": False,
                "AttachStdin": False,
                "AttachStdout": True,
                "AttachStderr": True,
                "Cmd": cmd,
                "Env": [f"{k}={v}" for k, v in env.items()],
                "WorkingDir": workdir,
            },
        )
        exec_id = made["Id"]
        # The daemon takes the connection over for the output and closes it at the end: a new
        # connection of its own (never a retry: that could run the command twice), no timeout (the
        # caller bounds the command and kills the container when it overruns).
        raw = self._once("POST", f"/exec/{exec_id}/start", {"Detach": False, "Tty": False}, None)
        # Without a TTY the output is always multiplexed, whatever Content-Type the daemon names
        # (20.10 says raw-stream).
        out = exec_output(raw)
        code = self._json("GET", f"/exec/{exec_id}/json").get("ExitCode")
        return (code if code is not None else -1), out

    def create(self, config: dict[str, Any], name: str) -> str:
        return self._json("POST", f"/containers/create?name={urllib.parse.quote(name)}", config)["Id"]

    def inspect(self, container: str) -> dict[str, Any]:
        return self._json("GET", f"/containers/{container}/json")

    def changes(self, container: str) -> list[dict[str, Any]]:
        """What the container changed in its image's filesystem: [{"Path", "Kind": 0 changed,
        1 added, 2 deleted}]."""
        return self._json("GET", f"/containers/{container}/changes") or []

    def commit(self, container: str, repo: str, tag: str) -> str:
        """The container's filesystem as a new image `repo:tag` (its config kept); the image id."""
        q = urllib.parse.urlencode({"container": container, "repo": repo, "tag": tag, "pause": "false"})
        return self._json("POST", f"/commit?{q}")["Id"]

    def remove_image(self, image: str) -> None:
        self._json("DELETE", f"/images/{urllib.parse.quote(image, safe='')}?force=1&noprune=0")

    def get_archive(self, container: str, path: str, chunk: int) -> Iterator[bytes]:
        """The tar of `path`, in chunks as the daemon writes it, on a connection of its own: closing
        the iterator early closes it, which stops the daemon's tar. DaemonRefused 404 when `path`
        does not exist."""
        conn, reply = self._open(
            "GET", f"/containers/{container}/archive?path={urllib.parse.quote(path)}", timeout=self.timeout
        )
        return _closing(conn, conn.body(reply, chunk))

    def put_archive(self, container: str, path: str, data: bytes | BinaryIO) -> None:
        """Unpack the tar `data` (bytes, or a file read from where it stands) into `path`."""
        if isinstance(data, bytes):
            size = len(data)
        else:
            at = data.tell()
            size = data.seek(0, os.SEEK_END) - at
            data.seek(at)
        conn, reply = self._open(
            "PUT",
            f"/containers/{container}/archive?path={urllib.parse.quote(path)}",
            data,
            {"Content-Type": "application/x-tar", "Content-Length": str(size)},
            timeout=self.timeout,
        )
        with contextlib.closing(conn):
            conn.read_body(reply)

    def kill(self, container: str) -> None:
        self._json("POST", f"/containers/{container}/kill")

    def start(self, container: str) -> None:
        self._json("POST", f"/containers/{container}/start")

    def pause(self, container: str) -> None:
        self._json("POST", f"/containers/{container}/pause")

    def wait(self, container: str, timeout: float) -> None:
        """Until the container is not running; a connection of its own, read within `timeout`."""
        self._once("POST", f"/containers/{container}/wait?condition=not-running", None, timeout)

    def top(self, container: str, ps_args: str) -> dict[str, Any]:
        return self._json("GET", f"/containers/{container}/top?ps_args={urllib.parse.quote(ps_args)}")

    def remove(self, container: str) -> None:
        self._json("DELETE", f"/containers/{container}?force=1")

    def _once(self, method: str, path: str, body: Any, timeout: float | None) -> bytes:
        """A JSON request on a connection of its own, read within `timeout`; the reply's body."""
        conn, reply = self._open(method, path, *_json_body(body), timeout=timeout)
        with contextlib.closing(conn):
            return conn.read_body(reply)

    def _open(
        self,
        method: str,
        path: str,
        body: bytes | BinaryIO | None = None,
        headers: dict[str, str] | None = None,
        *,
        timeout: float | None,
    ) -> tuple[_Connection, _Reply]:
        """A request on a new connection, and the reply once its status is not an error (else the
        connection is closed and DaemonRefused raised); the caller reads the body and closes."""
        conn = _Connection(self.socket_path, timeout)
        try:
            conn.request(method, self.prefix + path, body, headers)
            reply = conn.reply()
            if reply.status >= 400:
                raise _refused(reply.status, conn.read_body(reply))
        except BaseException:
            conn.close()
            raise
        return conn, reply

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        data, headers = _json_body(body)
        while True:
            conn = getattr(self._local, "conn", None)
            reused = conn is not None
            if conn is None:
                conn = self._local.conn = _Connection(self.socket_path, self.timeout)
            try:
                conn.request(method, self.prefix + path, data, headers)
                reply = conn.reply()
                raw = conn.read_body(reply)
            except Exception as e:
                conn.close()  # whatever state it was left in, the next call starts afresh
                self._local.conn = None
                # A kept-alive connection the daemon had closed: the request never reached it.
                if reused and isinstance(e, (DaemonClosed, BrokenPipeError, ConnectionResetError)):
                    continue
                raise
            if not conn.reusable:
                conn.close()
                self._local.conn = None
            break
        if reply.status >= 400:
            raise _refused(reply.status, raw)
        return json.loads(raw) if raw else {}


class _Reply:
    __slots__ = ("status", "length", "chunked")

    def __init__(self, status: int, length: int | None, chunked: bool):
        self.status = status
        self.length = length  # None: chunked, or read up to the close
        self.chunked = chunked


class _Connection:
    """One HTTP/1.1 connection to a Unix socket: a request written whole, and a reply read by the
    rules the daemon's server follows: a status line, headers up to an empty line, then a body of
    `Content-Length` bytes, in chunks (`Transfer-Encoding: chunked`), or up to the close (an
    exec's output); none for 1xx, 204 and 304. Interim 1xx replies are skipped (nothing here
    asks to upgrade)."""

    def __init__(self, path: str, timeout: float | None):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.rfile = sock.makefile("rb")
        self.reusable = True

    def request(
        self, method: str, target: str, body: bytes | BinaryIO | None, headers: dict[str, str] | None
    ) -> None:
        head = f"{method} {target} HTTP/1.1\r\nHost: docker\r\n"
        for k, v in (headers or {}).items():
            head += f"{k}: {v}\r\n"
        if isinstance(body, bytes):
            head += f"Content-Length: {len(body)}\r\n"
        elif body is None and method in ("POST", "PUT"):
            head += "Content-Length: 0\r\n"
        data = (head + "\r\n").encode("latin-1")
        if body is None or isinstance(body, bytes):
            self.sock.sendall(data + body if body else data)
            return
        self.sock.sendall(data)  # a file: its length is the caller's header
        while block := body.read(CHUNK):
            self.sock.sendall(block)

    def reply(self) -> _Reply:
        while True:
            line = self.rfile.readline(LINE)
            if not line:
                raise DaemonClosed("the daemon closed the connection before answering")
            parts = line.split(None, 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
                raise ConnectionError(f"not an HTTP reply from the daemon: {line[:100]!r}")
            status = int(parts[1])
            length, chunked, close = None, False, parts[0] == b"HTTP/1.0"
            while True:
                h = self.rfile.readline(LINE)
                if h in (b"\r\n", b"\n"):
                    break
                if not h.endswith(b"\n"):
                    raise ConnectionError("the daemon's reply headers were cut short")
                name, _, value = h.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = _number(value, 10)
                elif name == b"transfer-encoding":
                    chunked = b"chunked" in value.lower()
                elif name == b"connection":
                    close = b"close" in value.lower()
            if 100 <= status < 200:
                continue
            if status in (204, 304):
                length, chunked = 0, False
            elif chunked:
                length = None
            elif length is None:
                close = True  # the body runs to the close
            if close:
                self.reusable = False
            return _Reply(status, length, chunked)

    def body(self, reply: _Reply, size: int = CHUNK) -> Iterator[bytes]:
        """The reply's body in pieces of at most `size` bytes."""
        read = self.rfile.read
        if reply.chunked:
            while True:
                n = _number(self.rfile.readline(LINE).split(b";", 1)[0], 16)
                if n == 0:
                    while self.rfile.readline(LINE) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return
                yield from self._exactly(n, size)
                if self.rfile.readline(LINE) not in (b"\r\n", b"\n"):  # the end of each chunk
                    self.reusable = False
                    raise ConnectionError("the daemon's chunked reply was cut short or misframed")
        elif reply.length is not None:
            yield from self._exactly(reply.length, size)
        else:
            while data := read(size):
                yield data

    def _exactly(self, n: int, size: int) -> Iterator[bytes]:
        while n > 0:
            data = self.rfile.read(min(n, size))
            if not data:
                self.reusable = False
                raise ConnectionError("the daemon's reply was cut short")
            n -= len(data)
            yield data

    def read_body(self, reply: _Reply) -> bytes:
        return b"".join(self.body(reply))

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()


def _number(field: bytes, base: int) -> int:
    """A length or a chunk's size from the daemon; a field cut short or not a number is a broken
    connection (ConnectionError), as a body cut short is."""
    digits = field.strip()
    try:
        n = int(digits, base)
    except ValueError:
        n = -1
    if n < 0 or not digits.isalnum():
        raise ConnectionError(f"the daemon's reply has a broken length or chunk size: {field[:40]!r}")
    return n


def _closing(conn: _Connection, chunks: Iterator[bytes]) -> Iterator[bytes]:
    try:
        yield from chunks
    finally:
        conn.close()


def _json_body(body: Any) -> tuple[bytes | None, dict[str, str]]:
    """A request's body as JSON and its headers; none for None."""
    if body is None:
        return None, {}
    return json.dumps(body).encode(), {"Content-Type": "application/json"}


def exec_output(stream: bytes) -> bytes:
    """The payloads of the daemon's multiplexed stream, in the order written: frames of an 8-byte
    header (the stream: 1 stdout, 2 stderr; three zero bytes; the payload's length, big-endian)
    and the payload. A frame cut short at the end keeps what came of it."""
    out, i = [], 0
    while i + 8 <= len(stream):
        n = int.from_bytes(stream[i + 4 : i + 8], "big")
        out.append(stream[i + 8 : i + 8 + n])
        i += 8 + n
    return b"".join(out)


def _refused(status: int, raw: bytes) -> DaemonRefused:
    try:
        message = json.loads(raw).get("message") or ""
    except (ValueError, AttributeError):
        message = raw[:300].decode("utf-8", "replace")
    return DaemonRefused(status, message)


class SdkCalls:
    """`DaemonCalls`' calls through the SDK, for a daemon that is not a local Unix socket."""

    def __init__(self, api: Any):
        self.api = api

    def run(
        self, container: str, cmd: list[str], env: dict[str, str], workdir: str, user: str = ""
    ) -> tuple[int, bytes]:
        with _sdk_refusals():
            ex = self.api.exec_create(
                container, cmd, environment=env, workdir=workdir, stdin=False, tty=False, user=user
            )
            out = self.api.exec_start(ex["Id"], demux=False)
            code = self.api.exec_inspect(ex["Id"]).get("ExitCode")
        return (code if code is not None else -1), out or b""

    def create(self, config: dict[str, Any], name: str) -> str:
        with _sdk_refusals():
            return self.api.create_container_from_config(config, name)["Id"]

    def inspect(self, container: str) -> dict[str, Any]:
        with _sdk_refusals():
            return self.api.inspect_container(container)

    def changes(self, container: str) -> list[dict[str, Any]]:
        with _sdk_refusals():
            return self.api.diff(container) or []

    def commit(self, container: str, repo: str, tag: str) -> str:
        with _sdk_refusals():
            return self.api.commit(container, repository=repo, tag=tag, pause=False)["Id"]

    def remove_image(self, image: str) -> None:
        with _sdk_refusals():
            self.api.remove_image(image, force=True)

    def get_archive(self, container: str, path: str, chunk: int) -> Iterator[bytes]:
        with _sdk_refusals():
            stream, _stat = self.api.get_archive(container, path, chunk_size=chunk)
        return stream

    def put_archive(self, container: str, path: str, data: bytes | BinaryIO) -> None:
        with _sdk_refusals():
            if not self.api.put_archive(container, path, data):
                raise DaemonRefused(0, f"unpacking into {path} refused")

    def kill(self, container: str) -> None:
        with _sdk_refusals():
            self.api.kill(container)

    def start(self, container: str) -> None:
        with _sdk_refusals():
            self.api.start(container)

    def pause(self, container: str) -> None:
        with _sdk_refusals():
            self.api.pause(container)

    def wait(self, container: str, timeout: float) -> None:
        with _sdk_refusals():
            self.api.wait(container, timeout=timeout, condition="not-running")

    def top(self, container: str, ps_args: str) -> dict[str, Any]:
        with _sdk_refusals():
            return self.api.top(container, ps_args=ps_args)

    def remove(self, container: str) -> None:
        with _sdk_refusals():
            self.api.remove_container(container, force=True)


@contextlib.contextmanager
def _sdk_refusals() -> Iterator[None]:
    import docker.errors

    try:
        yield
    except docker.errors.APIError as e:
        raise DaemonRefused(e.status_code or 0, str(e.explanation or e)) from e

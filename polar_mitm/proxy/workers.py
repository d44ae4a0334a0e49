"""Several proxy processes behind one port, each session pinned to one of them (`proxy --workers N`).

One proxy process is one event loop on one core. With `--workers N` a small front process owns
the listening port; N worker processes each run the whole proxy (`PolarProxy`: mitmproxy, the
gateway, the policy and a writer of the same store file).

For each client connection the front reads the first request's head — a `CONNECT host:443`, or a
plain request, with the harness's `Proxy-Authorization: Basic SESSION:TOKEN` — picks a worker by
a hash of the session name, and hands the socket, with the bytes it read, to that worker over a
Unix socket (`SCM_RIGHTS`). From then on the worker alone reads and writes that connection: the
front costs one small read per connection, never a copy of the traffic.

All of a session's connections land on the same worker, so its conversation's cached prompts,
serialized ids and request memo stay in one process and later turns splice as they do with one
worker. Workers share nothing else; the store file is written by all of them (SQLite serializes
the commits and hands out `seq` itself). Tokens are checked by the workers, as with one proxy.

A worker is `python -m polar_mitm.proxy.workers FD`: its configuration arrives on stdin as
JSON, FD is its end of the front's Unix socket. It ignores SIGINT (Ctrl-C reaches the whole
process group) and stops cleanly when the front closes that socket, including when the front is
killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import zlib

from polar_mitm import procs
from polar_mitm.proxy.addons.sessions import session_from_auth
from polar_mitm.proxy.certs import CA, ensure_ca
from polar_mitm.proxy.embedded import PolarProxy, ProxyConfig, ProxyStartError, listen_socket, proxy_url
from polar_mitm.proxy.heads import HEAD_TIMEOUT, MAX_HEAD, header

log = logging.getLogger("polar_mitm.workers")

# A client's first request head larger than MAX_HEAD goes to a worker as far as it was read (the
# session is then the default one); mitmproxy answers it as it would.
STOP_GRACE = 5.0  # seconds a stopping worker gives its open connections to finish


def session_of(head: bytes) -> str | None:
    """The session named by the Proxy-Authorization header of a request head, if any."""
    return session_from_auth(header(head, b"proxy-authorization"))


def pick(session: str | None, workers: int) -> int:
    """The worker of a session: stable across processes and runs (crc32, not Python's hash)."""
    return zlib.crc32((session or "").encode()) % workers


def _wake(f: asyncio.Future[None]) -> None:
    """Wake the sender waiting on `f` (the control socket is writable again)."""
    if not f.done():
        f.set_result(None)


class WorkerPool:
    """The front: listens, starts the workers, and passes each new connection to one of them."""

    def __init__(self, config: ProxyConfig, workers: int, *, start_timeout: float = 120.0):
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self.config = config
        self.workers = workers
        self.start_timeout = start_timeout
        self.ca: CA | None = None
        self.port = 0
        self.handed = [0] * workers  # connections passed to each worker
        self.restarts = 0  # workers started again after they died
        self._listener: socket.socket | None = None
        self._procs: list[subprocess.Popen | None] = [None] * workers
        self._ctl: list[socket.socket | None] = [None] * workers
        self._locks = [asyncio.Lock() for _ in range(workers)]  # one hand-off or restart at a time
        self._accept: asyncio.Task | None = None
        self._pending: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Listen, start every worker and wait until each is serving; return the port.
        ProxyStartError (one line) when the port is taken or a worker cannot start."""
        self._listener = listen_socket(self.config.listen_host, self.config.listen_port)
        self.port = self._listener.getsockname()[1]
        self.ca = ensure_ca(self.config.certs_dir)  # once, before the workers read it
        try:
            for i in range(self.workers):
                self._spawn(i)
            for i in range(self.workers):
                await self._ready(i)
        except BaseException:
            await self.stop()
            raise
        self._accept = asyncio.create_task(self._accept_loop())
        return self.port

    def _spawn(self, index: int) -> None:
        front, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        front.setblocking(False)
        cfg = self.config.model_copy(update={"listen_host": "127.0.0.1", "listen_port": 0})
        env = {**os.environ, "POLAR_MITM_WORKER": str(index)}
        try:
            p = subprocess.Popen(
                [sys.executable, "-m", "polar_mitm.proxy.workers", str(child.fileno())],
                stdin=subprocess.PIPE,
                pass_fds=[child.fileno()],
                env=env,
            )
        finally:
            child.close()
        assert p.stdin is not None
        p.stdin.write(cfg.model_dump_json().encode())  # stdin, not argv: it may hold the token
        p.stdin.close()
        self._procs[index] = p
        self._ctl[index] = front

    async def _ready(self, index: int) -> None:
        """Wait for worker `index` to say it serves; ProxyStartError (one line) when it does not."""
        ctl, proc = self._ctl[index], self._procs[index]
        assert ctl is not None and proc is not None
        try:
            reply = await asyncio.wait_for(
                asyncio.get_running_loop().sock_recv(ctl, 4096), self.start_timeout
            )
        except TimeoutError:
            raise ProxyStartError(
                f"proxy worker {index} did not start within {self.start_timeout:.0f}s"
            ) from None
        if reply != b"ready":
            why = reply.decode(errors="replace") or f"exited ({proc.poll()})"
            raise ProxyStartError(f"proxy worker {index} did not start: {why}")

    async def _restart(self, index: int) -> None:
        """Start worker `index` again after it died (its sessions' next connections reach the new
        one; what it had in flight is lost, as with a killed proxy, and nothing half-done was
        committed)."""
        proc, ctl = self._procs[index], self._ctl[index]
        code = proc.poll() if proc is not None else None
        log.warning("proxy worker %d exited (%s); starting it again", index, code)
        if ctl is not None:
            ctl.close()
        if proc is not None and code is None:
            proc.kill()
        self._spawn(index)
        await self._ready(index)
        self.restarts += 1

    async def _send(self, index: int, head: bytes, fd: int) -> None:
        """Pass fd (and the bytes read from it) to worker `index`, starting the worker again first
        if it died; waits while the worker's socket buffer is full."""
        loop = asyncio.get_running_loop()
        async with self._locks[index]:
            for attempt in range(2):
                proc = self._procs[index]
                if proc is None or proc.poll() is not None:
                    await self._restart(index)
                ctl = self._ctl[index]
                assert ctl is not None
                while True:
                    try:
                        socket.send_fds(ctl, [head], [fd])
                        return
                    except BlockingIOError:
                        writable: asyncio.Future[None] = loop.create_future()
                        loop.add_writer(ctl.fileno(), _wake, writable)
                        try:
                            await writable
                        finally:
                            loop.remove_writer(ctl.fileno())
                    except OSError:  # the worker died after the check above
                        if attempt:
                            raise
                        if proc is not None:
                            await loop.run_in_executor(None, proc.wait)
                        break

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            task = asyncio.create_task(self._hand_off(conn))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _hand_off(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        head = b""
        try:
            async with asyncio.timeout(HEAD_TIMEOUT):
                while b"\r\n\r\n" not in head and len(head) < MAX_HEAD:
                    more = await loop.sock_recv(conn, MAX_HEAD - len(head))
                    if not more:
                        return  # closed before a whole head: nothing to serve
                    head += more
            i = pick(session_of(head), self.workers)
            await self._send(i, head, conn.fileno())
            self.handed[i] += 1
        except (TimeoutError, OSError) as e:  # ProxyStartError included: a worker that cannot restart
            log.warning("a connection was not handed to a proxy worker: %s", e)
        finally:
            conn.close()  # the worker holds its own descriptor of the connection

    async def stop(self) -> None:
        if self._accept is not None:
            self._accept.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept
        for t in list(self._pending):
            t.cancel()
        if self._listener is not None:
            self._listener.close()
        for ctl in self._ctl:
            if ctl is not None:
                ctl.close()  # each worker sees the end of its socket and stops
        loop = asyncio.get_running_loop()
        for p in self._procs:
            if p is None:
                continue
            await loop.run_in_executor(None, procs.wait_or_kill, p, 15)

    def session_url(self, session: str) -> str:
        return proxy_url(self.config.listen_host, self.port, session, self.config.token)

    @property
    def url(self) -> str:
        return f"http://{self.config.listen_host}:{self.port}"


async def serve_worker(config: ProxyConfig, ctl: socket.socket) -> None:
    """A worker: the whole proxy, serving the connections the front sends over `ctl`."""
    proxy = PolarProxy(config)
    try:
        await proxy.start()
        assert proxy.store is not None
        await proxy.store.ensure_session(config.default_session, harness="shared-proxy", mode=config.mode)
    except Exception as e:  # reported to the front, which names it in one line
        with contextlib.suppress(OSError):  # the front may have given up already
            ctl.sendall(f"{type(e).__name__}: {e}".splitlines()[0].encode()[:4000])
        await proxy.stop()
        return
    try:
        ctl.sendall(b"ready")
    except OSError:  # the front gave up (another worker failed, or it was stopped)
        await proxy.stop()
        return
    ctl.setblocking(False)
    loop = asyncio.get_running_loop()
    closed = loop.create_future()
    serving: set[asyncio.Task] = set()

    def readable() -> None:
        try:
            head, fds, _, _ = socket.recv_fds(ctl, MAX_HEAD, 4)
        except BlockingIOError:
            return
        except OSError:
            head, fds = b"", []
        if not head and not fds:  # the front is gone
            loop.remove_reader(ctl.fileno())
            if not closed.done():
                closed.set_result(None)
            return
        for fd in fds:
            task = loop.create_task(proxy.adopt(socket.socket(fileno=fd), head))
            serving.add(task)
            task.add_done_callback(serving.discard)

    loop.add_reader(ctl.fileno(), readable)
    try:
        await closed
        if serving:  # connections still open: their turns may be finishing (a store write)
            await asyncio.wait(list(serving), timeout=STOP_GRACE)
    finally:
        for t in list(serving):
            t.cancel()
        await proxy.stop()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when workers stop
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctl = socket.socket(fileno=int(sys.argv[1]))
    config = ProxyConfig.model_validate_json(sys.stdin.buffer.read())
    asyncio.run(serve_worker(config, ctl))


if __name__ == "__main__":
    main()

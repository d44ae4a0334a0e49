"""A sandbox's forwarder: 127.0.0.1:PORT inside the sandbox -> the sample's Unix socket.

Run as `python3 forward.py SOCKET PORT serve` (a container's entrypoint: it stays in front), or
without `serve` to detach once listening (the command returns when the port is open). Once it
listens it says so to the host: it connects to the socket once and closes without a byte. Each
TCP connection is passed to the socket, byte for byte, both ways, half-closes included. Standard
library only, any Python 3. `forward.js` is the same for the node binary we mount for
JavaScript harnesses.
"""

import os
import signal
import socket
import sys
import threading

CHUNK = 256 * 1024


def pump(src, dst):
    try:
        while True:
            data = src.recv(CHUNK)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def handle(client, path):
    up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        up.connect(path)
    except OSError:
        client.close()
        up.close()
        return
    back = threading.Thread(target=pump, args=(up, client), daemon=True)
    back.start()
    pump(client, up)
    back.join()
    client.close()
    up.close()


def main():
    path, port = sys.argv[1], int(sys.argv[2])
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(256)
    if sys.argv[3:4] != ["serve"]:
        if os.fork():
            os._exit(0)  # listening: the starter may go on
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
    if os.getpid() == 1 and "keep-orphans" not in sys.argv[4:]:
        # The container's init: orphans are reaped. Not in a verifier ("keep-orphans"): there a
        # process that detached from the tests must stay visible, as a zombie, once it exited.
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    hello = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        hello.connect(path)
    except OSError:
        pass
    hello.close()
    while True:
        client, _ = server.accept()
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=handle, args=(client, path), daemon=True).start()


if __name__ == "__main__":
    main()

"""A sandbox's forwarder: 127.0.0.1:PORT inside the sandbox -> the sample's Unix socket.

Run as `python3 forward.py SOCKET PORT`: it listens, then detaches (the command returns once the
port is open, so whoever started it knows it is ready) and passes each TCP connection to the
socket, byte for byte, both ways, half-closes included. Standard library only, any Python 3.
`forward.js` is the same for the node binary we mount for JavaScript harnesses.
"""

import os
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
    if os.fork():
        os._exit(0)  # listening: the starter may go on
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    while True:
        client, _ = server.accept()
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=handle, args=(client, path), daemon=True).start()


if __name__ == "__main__":
    main()

"""What a sandbox's files say, read on the host as untrusted, for both container runtimes: a tar
streamed from a daemon (one regular file, bounded by its header before it is read), the agent's
workdir tar filtered to what stays inside it (no absolute or `..` paths, devices, or paths through
links), a file beneath an overlay's upper directory with no link followed, and a tree's claimed
size (file sizes, nothing read), so a huge or sparse artefact is refused before a byte is copied.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from polar_mitm.sandbox.base import READ_LIMIT, Unreadable


def tree_size(root: str | Path, limit: int) -> int:
    """The bytes the files under `root` claim (their sizes, links not followed: a sparse file
    counts in full, nothing is read), counted until past `limit`."""
    total, stack = 0, [str(root)]
    while stack and total <= limit:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        else:
                            total += e.stat(follow_symlinks=False).st_size + 512  # a tar header each
                    except OSError:
                        continue
        except OSError:
            continue
    return total


class _Chunks(io.RawIOBase):
    """A readable file over an iterator of byte chunks (a daemon's streamed tar)."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks = chunks
        self._left = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        while not self._left:
            try:
                self._left = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(buf), len(self._left))
        buf[:n] = self._left[:n]
        self._left = self._left[n:]
        return n


def _kind(m: tarfile.TarInfo) -> str:
    if m.isdir():
        return "a directory"
    if m.issym() or m.islnk():
        return f"a link to {m.linkname[:100]!r}"
    return "a FIFO or a device" if m.isfifo() or m.isdev() else "not a regular file"


def tar_file(chunks: Iterator[bytes], path: str, limit: int) -> bytes:
    """The bytes of the one regular file `path` from a tar of it streamed in chunks (what a
    container daemon's archive of a path gives): its first member must be that file, by name,
    a regular file (no link, no directory member), of at most `limit` bytes by its header; no more
    of the stream is read than the file. `Unreadable` otherwise."""
    name = PurePosixPath(path).name
    with tarfile.open(fileobj=io.BufferedReader(_Chunks(chunks), 1 << 16), mode="r|") as tar:
        m = tar.next()
        if m is None:
            raise Unreadable(f"{path}: an empty archive")
        if PurePosixPath(m.name.rstrip("/")).name != name:
            raise Unreadable(f"{path}: the archive holds {m.name[:100]!r}")
        if not m.isreg():
            raise Unreadable(f"{path} is {_kind(m)}, not a regular file")
        if m.size > limit:
            raise Unreadable(f"{path} holds {m.size} bytes, more than the {limit} read")
        f = tar.extractfile(m)
        return f.read(limit) if f is not None else b""


def safe_members(src: BinaryIO, into: BinaryIO, top: str) -> list[str]:
    """Copy the tar `src` into `into` keeping only members under `top/` that stay there: no
    absolute or `..` paths, no devices or fifos, no hard link to outside, no member reached through
    a symbolic link of the archive. Returns the names dropped (streamed: neither held whole)."""
    dropped: list[str] = []
    links: set[str] = set()
    src.seek(0)
    with tarfile.open(fileobj=src, mode="r|") as tin, tarfile.open(fileobj=into, mode="w|") as tout:
        for m in tin:
            p = PurePosixPath(m.name)
            parts = p.parts
            bad = (
                p.is_absolute()
                or ".." in parts
                or not parts
                or parts[0] != top
                or m.ischr()
                or m.isblk()
                or m.isfifo()
                or any(str(PurePosixPath(*parts[:i])) in links for i in range(1, len(parts)))
            )
            if m.islnk():
                target = PurePosixPath(m.linkname)
                bad = bad or target.is_absolute() or ".." in target.parts or target.parts[:1] != (top,)
            if bad:
                dropped.append(m.name)
                continue
            if m.issym():
                links.add(str(p))
            tout.addfile(m, tin.extractfile(m) if m.isfile() else None)
    return dropped


def read_beneath(root: Path, path: str, limit: int = READ_LIMIT) -> bytes | None:
    """The regular file at `path` under the directory `root` (an overlay's upper directory), no
    link followed on the way; None when nothing is there, `Unreadable` when it is not a regular
    file or holds more than `limit` bytes (by its size, before a byte is read)."""
    parts = [p for p in PurePosixPath(path).parts if p not in ("/", "")]
    if not parts or ".." in parts:
        return None
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
        try:
            st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)})")
        f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:  # a link on the way (ELOOP), or a directory standing for the file
        raise Unreadable(f"{path}: {e.strerror}") from None
    finally:
        os.close(fd)
    with os.fdopen(f, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(f"{path} is not a regular file")
        if st.st_size > limit:
            raise Unreadable(f"{path} holds {st.st_size} bytes, more than the {limit} read")
        return fh.read(limit)

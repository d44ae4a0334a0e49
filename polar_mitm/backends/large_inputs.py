"""Requests too large to be cheap, kept from costing every other session.

Tokenizing runs at about a megabyte of text a second, holds the GIL throughout (so a thread does
not let the event loop run), and the tokenizers library needs ~350 bytes of memory per token
while it works, which glibc keeps after it is freed: one 20 MB request stalled every session for
~25 s and left the proxy 1.9 GB larger. The defences, besides the gateway's cap on body bytes:

- `prompt_tokens_at_least`: the fewest tokens a request's prompt can take, from its text alone.
  No token stands for more bytes than the tokenizer's longest one (`longest_token_bytes`), and
  every chat template renders the text of system, user and tool messages, so their bytes over
  that length bound the prompt from below. The policy refuses a request this bound puts past
  its context before anything is tokenized (`polar_mitm.policy.admission`).
- `body_tokens_at_least`: the same kind of bound read from the request body's JSON alone, before
  the style parses it (parsing, hashing and rendering a 70,000-message body takes ~15 s of the
  proxy's time). A user message whose content is a plain string becomes one user message of
  that text in every style, and where the chat template puts each user message's text in a
  stretch of its own after an added token (`users_delimited`, checked on a probe conversation),
  each such message takes at least one token for that added token and its own text's share.
- `PooledTokenizer`: texts longer than `LONG_TEXT` characters are encoded in worker processes
  (the same tokenizer directory, so the same ids) while the calling thread waits without the
  GIL. One worker stays warm between long texts; one that encoded more than `RECYCLE_TEXT`
  characters exits afterwards, so the memory the encoding took goes back to the system.
- `release_memory_soon`: after a large body, the proxy's own heap is trimmed (glibc).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import struct
import subprocess
import sys
import threading
from array import array
from collections.abc import Iterable
from typing import IO, Any

import orjson

from polar_mitm import procs
from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.neutral import Message, ProviderError
from polar_mitm.once import once

log = logging.getLogger("polar_mitm.large_inputs")

LONG_TEXT = 64 * 1024  # characters: ~50 ms of tokenizing in-process; longer texts go to a worker
RECYCLE_TEXT = 1024 * 1024  # characters: a worker that encoded a longer text exits afterwards
MAX_WORKERS = 4  # long texts encoded at once; more wait for a worker

# Roles whose content every chat template renders in full (assistant content may lose what
# precedes a reasoning block's end, and reasoning may be dropped from earlier turns).
_RENDERED_ROLES = ("system", "user", "tool")


def _by_directory(tok: Tokenizer) -> str:
    return tok.path


@once(key=_by_directory)
def longest_token_bytes(tok: Tokenizer) -> int:
    """The most bytes of text one token of `tok` can stand for: the longest UTF-8 text a single id
    decodes to, or its vocabulary entry's length in characters where that is longer (an entry
    whose decoding drops a leading space, or a byte-level entry: one character per byte). Read
    once per tokenizer directory (~0.5 s for 150k ids on 2 cores; it was 0.9 s an id at a time),
    single-flight (`polar_mitm.once`): the callers meanwhile wait for that one reading."""
    return max(
        1,
        max((len(t.encode("utf-8", "replace")) for t in tok.decode_each(range(tok.vocab_size))), default=1),
        max(map(len, tok.entries()), default=1),
    )


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "replace"))


_PROBE_USERS = ("polar probe one", "polar probe two", "polar probe three")


@once(key=_by_directory)
def users_delimited(tok: Tokenizer) -> bool:
    """Whether `tok`'s chat template renders each user message's text between added tokens of its
    own, at least one of them before it: checked on a probe conversation (a system prompt, two
    user messages in a row, a reply, a third user message), whose user texts must each lie in a
    different stretch between added tokens, each after at least one. Where it holds, a prompt has
    at least one token per user message plus its text's bytes over the longest token. Once per
    tokenizer directory (single-flight); False when the template cannot render the probe."""
    one, two, three = _PROBE_USERS
    probe = [
        {"role": "system", "content": "polar probe system"},
        {"role": "user", "content": one},
        {"role": "user", "content": two},
        {"role": "assistant", "content": "polar probe reply"},
        {"role": "user", "content": three},
    ]
    try:
        ids = tok.encode(tok.render(probe, add_generation_prompt=True))
    except Exception:  # a template that refuses the probe: no per-message bound
        ids = []
    stretches: list[list[int]] = [[]]  # the ids between added tokens; the first has none before it
    for i in ids:
        if i in tok.added_ids:
            stretches.append([])
        else:
            stretches[-1].append(i)
    texts = [tok.decode(s) for s in stretches]
    holders = [[k for k, t in enumerate(texts) if u in t] for u in _PROBE_USERS]
    found = [h[0] for h in holders if len(h) == 1]
    return len(found) == len(_PROBE_USERS) and len(set(found)) == len(found) and min(found) > 0


def user_text_bytes(body: Any) -> list[int]:
    """UTF-8 bytes of each user message of a request body (its JSON, not yet read by a style) whose
    content is a plain string: in `messages` (Anthropic, OpenAI chat) and `input` (OpenAI
    Responses; a string input is one user message). Every style reads each of them as one user
    message of that text whatever surrounds it; what else the body holds is left out, so a bound
    built on these stays a lower one."""
    if not isinstance(body, dict):
        return []
    items = body.get("messages")
    if not isinstance(items, list):
        items = body.get("input")
        if isinstance(items, str):
            return [_utf8_len(items)]
        if not isinstance(items, list):
            return []
    return [
        _utf8_len(m["content"])
        for m in items
        if isinstance(m, dict)
        and m.get("role") == "user"
        and m.get("type", "message") == "message"
        and isinstance(m.get("content"), str)
        and m["content"]
    ]


def body_tokens_at_least(raw: bytes, longest: int, delimited: bool) -> tuple[int, int, int]:
    """(the fewest tokens the prompt of this request body can take, the user messages and their
    text bytes that say so), from its JSON alone; (0, 0, 0) for a body that is not JSON (the
    style says what is wrong with it). With `delimited` (see `users_delimited`), each user message
    takes at least one added token and its own text's bytes over `longest`; otherwise all their
    text bytes together over `longest`."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return 0, 0, 0
    sizes = user_text_bytes(body)
    total = sum(sizes)
    if delimited:
        return sum(1 + -(-n // longest) for n in sizes), len(sizes), total
    return -(-total // longest), len(sizes), total


def rendered_text_bytes(messages: Iterable[Message]) -> int:
    """UTF-8 bytes of the message text every chat template renders (system, user, tool)."""
    total = 0
    for m in messages:
        if m.role in _RENDERED_ROLES:
            total += len(m.content) if m.content.isascii() else len(m.content.encode("utf-8", "replace"))
    return total


def prompt_tokens_at_least(messages: Iterable[Message], longest: int) -> tuple[int, int]:
    """(the fewest tokens the prompt of these messages can take, the text bytes that says so)."""
    n = rendered_text_bytes(messages)
    return -(-n // longest), n


# ---- memory back to the system ------------------------------------------------------------------

RELEASE_AFTER_BYTES = 1024 * 1024  # a request body this large leaves the heap much larger


def _find_malloc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_MALLOC_TRIM = _find_malloc_trim()


def release_memory() -> None:
    """Hand the heap's free memory back to the system. glibc keeps what a large request freed
    (parsing, tokenizing and storing 20 MB left the proxy 1.9 GB larger) until asked to trim;
    ctypes lets go of the GIL meanwhile."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def release_memory_soon(delay: float = 1.0) -> None:
    """`release_memory` in a thread once the request being answered is done with its memory."""
    loop = asyncio.get_running_loop()
    loop.call_later(delay, lambda: loop.run_in_executor(None, release_memory))


# ---- long texts in worker processes ---------------------------------------------------------------


_HEADER = struct.Struct("<Q")  # the byte length of each message between a worker and the proxy


def _send(stream: IO[bytes], data: bytes) -> None:
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream: IO[bytes]) -> bytes:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("the worker's pipe closed")
    (n,) = _HEADER.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("the worker's pipe closed")
    return data


def serve(path: str) -> None:
    """A worker (`python -m polar_mitm.backends.large_inputs DIR`): encode each text it reads
    from stdin with the tokenizer in DIR and write back its ids (int32), until stdin closes."""
    tok = Tokenizer.load(path)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    _send(stdout, b"ready")
    while True:
        try:
            text = _receive(stdin).decode("utf-8", "surrogatepass")
        except EOFError:
            return
        _send(stdout, array("i", tok.encode(text)).tobytes())


class _Worker:
    """One worker process, spoken to over its stdin and stdout. A plain subprocess rather than
    multiprocessing's: it needs nothing of the proxy's own __main__, so it starts however the
    proxy was started (console script, -m, a notebook); when the proxy goes, its stdin closes."""

    def __init__(self, path: str):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "polar_mitm.backends.large_inputs", path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.stdin, self.stdout = self.process.stdin, self.process.stdout
        if _receive(self.stdout) != b"ready":  # the tokenizer is loaded (EOFError if it failed)
            raise EOFError("the worker did not start")

    def encode(self, text: str) -> list[int]:
        _send(self.stdin, text.encode("utf-8", "surrogatepass"))
        out = array("i")
        out.frombytes(_receive(self.stdout))
        return out.tolist()

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        try:
            self.stdin.close()  # the worker's loop ends
        except OSError:
            pass
        procs.wait_or_kill(self.process, 5)
        self.stdout.close()


class _Pool:
    """The worker processes of one tokenizer directory, shared by every PooledTokenizer of it:
    at most MAX_WORKERS at work, one kept idle between long texts."""

    def __init__(self, path: str):
        self.path = path
        self._idle: list[_Worker] = []
        self._slots = threading.Semaphore(MAX_WORKERS)
        self._lock = threading.Lock()
        self.broken = False  # workers cannot start here (e.g. no importable __main__): in-process
        self.encoded = 0  # texts encoded in workers
        self.started = 0  # workers started

    def encode(self, text: str, recycle_text: int) -> list[int] | None:
        """The ids of `text`, from a worker; None when no worker can start."""
        with self._slots:
            worker = self._checkout()
            if worker is None:
                return None
            try:
                ids = worker.encode(text)
            except (EOFError, OSError):
                worker.close()
                raise ProviderError(
                    "request_too_large",
                    f"the prompt is too large to tokenize here: the worker process tokenizing its "
                    f"{len(text):,} characters ended (exit code {worker.process.poll()}; out of memory?)",
                    413,
                ) from None
            self.encoded += 1
            with self._lock:
                keep = len(text) <= recycle_text and not self._idle
                if keep:
                    self._idle.append(worker)
            if not keep:
                worker.close()  # its memory goes back; the next long text gets a fresh worker
            return ids

    def _checkout(self) -> _Worker | None:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            if self.broken:
                return None
        try:
            worker = _Worker(self.path)
        except (EOFError, OSError) as e:
            log.warning(
                "cannot start a tokenizer worker process (%r); long texts are tokenized in-process", e
            )
            self.broken = True
            return None
        self.started += 1
        return worker

    def idle(self) -> int:
        """Idle workers still running."""
        with self._lock:
            return sum(w.alive() for w in self._idle)


@once
def _pool_for(path: str) -> _Pool:
    return _Pool(path)


class PooledTokenizer:
    """`tok`, except that `encode` sends texts longer than `long_text` characters to worker
    processes (shared by every PooledTokenizer of the same directory). Everything else is `tok`'s
    own. Thread-safe: render functions call it from threads, and a thread waiting for a worker
    holds no GIL."""

    def __init__(self, tok: Tokenizer, *, long_text: int = LONG_TEXT, recycle_text: int = RECYCLE_TEXT):
        self._tok = tok
        self.long_text = long_text
        self.recycle_text = recycle_text
        self.pool = _pool_for(tok.path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def __repr__(self) -> str:
        return f"PooledTokenizer({self._tok!r})"

    def encode(self, text: str) -> list[int]:
        if len(text) > self.long_text:
            ids = self.pool.encode(text, self.recycle_text)
            if ids is not None:
                return ids
        return self._tok.encode(text)


def pooled(tok: Tokenizer) -> Tokenizer:
    """`tok` as a PooledTokenizer (typed as the Tokenizer it stands in for)."""
    return PooledTokenizer(tok)  # type: ignore[return-value]


if __name__ == "__main__":
    serve(sys.argv[1])

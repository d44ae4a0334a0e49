"""Server-sent events: the one writer every API style renders with, and the one reader: `parse`
for a whole recorded body (harvest mode, the tests), `Reader` for a stream as it arrives (the
engine client's reply stream, the viewer's live feed of the service's events).

Styles differ only in whether an event names itself (`event:` lines: Anthropic, Responses) and
in the line ending (Google ends events with CRLF CRLF); both are arguments here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from polar_mitm import jsontext

# (event name, data object) of one event that carries a JSON object.
JsonEvent = tuple[str | None, dict[str, Any]]


def encode(data: dict[str, Any] | str, *, event: str | None = None, eol: str = "\n") -> bytes:
    """One event: an optional `event:` line, then the data (a JSON object on one line, or text).
    The object is written by `jsontext.dumps` (orjson: compact, as the providers write it; several
    events a turn), which writes NaN and infinities as null: valid JSON where `json` would write
    JavaScript."""
    text = data.encode() if isinstance(data, str) else jsontext.dumps(data)
    head = f"event: {event}{eol}".encode() if event is not None else b""
    sep = eol.encode()
    return b"".join((head, b"data: ", text, sep, sep))


def comment(text: str) -> bytes:
    """An SSE comment: every client skips it, and it keeps idle timeouts away."""
    return f": {text}\n\n".encode()


@dataclass(frozen=True)
class SSEEvent:
    event: str | None
    data: str


def parse(text: str) -> list[SSEEvent]:
    """The events of an SSE body (fields `event` and `data`; comments and `id`/`retry` ignored)."""
    out: list[SSEEvent] = []
    name: str | None = None
    data: list[str] = []
    for line in re.split(r"\r\n|\r|\n", text) + [""]:
        if not line:
            if data:
                out.append(SSEEvent(name, "\n".join(data)))
            name, data = None, []
            continue
        if line.startswith(":"):
            continue
        key, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if key == "event":
            name = value
        elif key == "data":
            data.append(value)
    return out


def json_events(body: str | bytes) -> list[JsonEvent]:
    """The events of an SSE body whose data is a JSON object (`[DONE]` and other text left out)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    out: list[JsonEvent] = []
    for ev in parse(text):
        try:
            data = json.loads(ev.data)
        except ValueError:
            continue
        if isinstance(data, dict):
            out.append((ev.event, data))
    return out


class Reader:
    """An SSE stream read as its chunks arrive: `feed` (events) or `data` (their data lines only,
    as bytes: the engine client's hot path, no decoding) with each chunk returns what the chunk
    completed; a partial event waits for the next chunk.

    Events end with a blank line written LF LF, as the engines and our service write them (a
    CRLF stream, Google's, is read whole with `parse`).
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def _complete(self, chunk: bytes) -> bytes:
        buf = self._buf
        buf += chunk
        end = buf.rfind(b"\n\n")
        if end < 0:
            return b""
        events = bytes(buf[:end])
        del buf[: end + 2]
        return events

    def data(self, chunk: bytes) -> list[bytes]:
        """The `data:` lines of the events `chunk` completed, each stripped, in order."""
        buf = self._buf  # `_complete` written out: this runs once per chunk of every reply
        buf += chunk
        end = buf.rfind(b"\n\n")
        if end < 0:
            return []
        events = bytes(buf[:end])
        del buf[: end + 2]
        return [line[5:].strip() for line in events.split(b"\n") if line.startswith(b"data:")]

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """The events `chunk` completed (as `parse` reads them)."""
        events = self._complete(chunk)
        return parse(events.decode("utf-8", "replace") + "\n\n") if events else []

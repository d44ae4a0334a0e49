"""Harvest mode's pure logic: a real provider exchange → one stored text turn.

In harvest mode the harness talks to the real provider (or an `--upstream` mapped in its place);
the proxy only watches. What it stores per model exchange is built here, without mitmproxy:

- `assemble(style, body, content_type)`: the upstream's reply, SSE or JSON, as one reply in the
  style's own JSON shape (an SSE stream becomes the message the non-streaming API would have
  returned, usage included), by the style's own `assemble`. The style's `parse_reply` (lenient:
  an upstream reply may be malformed) reads it back for exports, exactly as it reads the same
  reply echoed in the next request.
- `Exchange`: one request and its reply, turned into a `Turn` with every credential removed
  (headers and query parameters through `polar_mitm.redact`, and any secret value that shows up
  in a body replaced as well), so nothing secret reaches the store.
- `parse_upstream`: `--upstream HOST=URL`.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from polar_mitm import redact, sse
from polar_mitm.neutral import ChatRequest, ProviderError, new_turn_id
from polar_mitm.providers import Style
from polar_mitm.store.turn import Turn

# ---- the upstream's reply ------------------------------------------------------------------------


def is_sse(content_type: str | None) -> bool:
    return bool(content_type and "text/event-stream" in content_type.lower())


def assemble(style: Style, body: bytes, content_type: str | None) -> dict[str, Any]:
    """The upstream's reply as one JSON object in the style's own shape.

    An SSE body is assembled by the style (`Style.assemble`); a JSON body is the reply already,
    except a JSON array of chunks (Gemini's streamGenerateContent without alt=sse), which is
    assembled like a stream. Anything else is kept as `{"text": ...}`.
    """
    text = body.decode("utf-8", "replace")
    if is_sse(content_type):
        return style.assemble(sse.json_events(text))
    try:
        data = json.loads(text) if text.strip() else {}
    except ValueError:
        return {"text": text}
    if isinstance(data, list):
        return style.assemble([(None, d) for d in data if isinstance(d, dict)])
    return data if isinstance(data, dict) else {"value": data}


def error_of(reply: dict[str, Any]) -> str | None:
    """The error a provider reported inside its reply (every style nests it under "error")."""
    err = reply.get("error")
    if not err:
        return None
    if isinstance(err, dict):
        return str(err.get("message") or err.get("type") or json.dumps(err, ensure_ascii=False))
    return str(err)


# ---- credentials -------------------------------------------------------------------------------

# Shorter values (a "1", a "true") would blank out ordinary text; credentials are never that short.
MIN_SECRET_LEN = 8


def secret_values(headers: Iterable[tuple[str, str]], url: str) -> set[str]:
    """Every credential a request carries: secret header values (and the token inside
    `Bearer …` / `Basic …`, and cookie values) and secret query parameters."""
    found: set[str] = set()
    for k, v in headers:
        lk = k.lower()
        if not (lk in redact.SECRET_HEADERS or "secret" in lk or "token" in lk):
            continue
        found.add(v.strip())
        scheme, _, token = v.strip().partition(" ")
        if token:
            found.add(token.strip())
            if scheme.lower() == "basic":
                try:
                    found.update(base64.b64decode(token.strip()).decode().split(":", 1))
                except (binascii.Error, UnicodeDecodeError):
                    pass
        if lk in ("cookie", "set-cookie"):
            for part in v.split(";"):
                found.add(part.partition("=")[2].strip())
    for k, v in parse_qsl(urlsplit(url).query, keep_blank_values=False):
        if k.lower() in redact.SECRET_PARAMS:
            found.add(v)
    return {s for s in found if len(s) >= MIN_SECRET_LEN}


def scrub(text: str | None, secrets: Iterable[str]) -> str | None:
    """`text` with every secret value replaced by the redaction marker."""
    if text is None:
        return None
    for s in sorted(secrets, key=len, reverse=True):
        text = text.replace(s, redact.REDACTED)
    return text


# ---- one exchange → one stored turn ----------------------------------------------------------------

Tagger = Callable[[ChatRequest, str, Mapping[str, str]], str | None]  # (request, path, headers)
_MODEL_IN_PATH = re.compile(r"/models/([^/:?]+)")


@dataclass
class Exchange:
    """A model request the proxy forwarded, and (as it streams back) its reply."""

    session_id: str
    style: Style
    host: str
    method: str
    path: str
    request_headers: list[tuple[str, str]]
    request_body: bytes
    started: float = field(default_factory=time.time)
    # The reply's bytes as they pass to the harness (decoded of any content-encoding at the end).
    reply: bytearray = field(default_factory=bytearray)
    max_reply_bytes: int = 64 * 1024 * 1024
    truncated: bool = False

    def tee(self, chunk: bytes) -> bytes:
        """mitmproxy's `response.stream` callable: keep a copy, pass the chunk on unchanged."""
        if len(self.reply) + len(chunk) <= self.max_reply_bytes:
            self.reply += chunk
        elif chunk:
            self.truncated = True
        return chunk

    def record(
        self,
        *,
        status_code: int | None,
        content_type: str | None,
        reply_body: bytes | None,
        ended: float | None = None,
        failure: str | None = None,
        tagger: Tagger | None = None,
    ) -> Turn:
        """The exchange as a text turn: raw request and assembled reply, no token ids, no secrets.

        `failure` is set when the exchange did not complete (upstream unreachable, a side hung
        up mid-stream); the turn is then stored as aborted, with whatever reply had arrived.
        """
        secrets = secret_values(self.request_headers, self.path)
        request_text = self.request_body.decode("utf-8", "replace")
        try:
            body: Any = json.loads(request_text)
        except ValueError:
            body = None
        model = body.get("model") if isinstance(body, dict) else None
        if not model and (m := _MODEL_IN_PATH.search(self.path)):
            model = m.group(1)
        tag = None
        if tagger is not None and body is not None:
            try:
                tag = tagger(
                    self.style.parse_request(body, path=self.path), self.path, dict(self.request_headers)
                )
            except (ProviderError, ValueError, TypeError, KeyError):
                tag = None
        reply: dict[str, Any] | None = None
        finish: str | None = None
        error = failure
        if reply_body is not None and (reply_body or status_code is not None):
            reply = assemble(self.style, reply_body, content_type)
            if self.truncated:
                reply["polar_truncated"] = True
            error = error or error_of(reply)
            if status_code is not None and status_code >= 400:
                error = error or f"HTTP {status_code}"
            elif error is None:
                try:
                    finish = self.style.parse_reply(reply, lenient=True)[1]
                except ProviderError:
                    finish = None
        status = "aborted" if failure else ("error" if error else "ok")
        ended = ended if ended is not None else time.time()
        return Turn(
            id=new_turn_id(),
            session_id=self.session_id,
            created_at=self.started,
            style=self.style.NAME,
            host=self.host,
            path=scrub(redact.url(self.path), secrets),
            model=str(model) if model else None,
            tag=tag,
            status=status,
            finish_reason=finish or ("abort" if failure else ("error" if error else None)),
            request=scrub(request_text, secrets),
            request_headers={
                k: scrub(v, secrets) or "" for k, v in redact.headers(self.request_headers).items()
            },
            response=scrub(json.dumps(reply, ensure_ascii=False), secrets) if reply is not None else None,
            error=scrub(error, secrets),
            latency_ms=max(0.0, (ended - self.started) * 1000),
        )


# ---- --upstream HOST=URL -------------------------------------------------------------------------


@dataclass(frozen=True)
class Upstream:
    """Where requests for one provider host go instead of the host itself."""

    scheme: str
    host: str
    port: int
    path_prefix: str = ""

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.path_prefix}"


def parse_upstream(spec: str) -> tuple[str, Upstream]:
    """`api.anthropic.com=https://127.0.0.1:8443[/prefix]` → (host, Upstream)."""
    host, sep, url = spec.partition("=")
    host = host.strip().lower()
    if not sep or not host or not url:
        raise ValueError(
            f"--upstream {spec!r}: expected HOST=URL, e.g. api.anthropic.com=https://10.0.0.5:8443"
        )
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--upstream {spec!r}: the URL must be http(s)://HOST[:PORT][/PREFIX]")
    if parts.username or parts.password:
        raise ValueError(f"--upstream {spec!r}: credentials in the URL would be stored; leave them out")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:
        raise ValueError(f"--upstream {spec!r}: {e}") from None
    return host, Upstream(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

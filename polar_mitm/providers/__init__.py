"""The API styles, one module each, and the registry that routes a request to one.

Each style module implements `base.Style` (the module is the object): its hosts and endpoints,
`parse_request` / `parse_reply` into the neutral model, `render_response` / `render_stream` back
to native JSON or SSE, `assemble` of a recorded stream, and its errors. `STYLES` lists them and
is where the type checker holds each module to the protocol; a new style is a new module added
there.

The registry is built once, at import: each style's own hosts plus the hosts the harness recipes
name (e.g. Codex's chatgpt.com), and it is not changed afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from polar_mitm.providers import anthropic, gemini, openai_chat, openai_responses
from polar_mitm.providers.base import Endpoint, Style

__all__ = ["HOST_STYLES", "STYLES", "Style", "error_style", "route"]

# The order a host's styles are tried in: OpenAI's host serves Chat Completions and Responses.
_ALL: tuple[Style, ...] = (anthropic, gemini, openai_chat, openai_responses)

STYLES: Mapping[str, Style] = MappingProxyType({s.NAME: s for s in _ALL})


def _host_styles() -> Mapping[str, tuple[Style, ...]]:
    from polar_mitm.runtime import recipes

    pairs = [(h, s) for s in _ALL for h in s.HOSTS]
    pairs += [(h, STYLES[name]) for h, name in sorted(recipes.provider_hosts().items()) if name in STYLES]
    hosts: dict[str, list[Style]] = {}
    for host, style in pairs:
        styles = hosts.setdefault(host.lower(), [])
        if style not in styles:
            styles.append(style)
    return MappingProxyType({h: tuple(sorted(ss, key=_ALL.index)) for h, ss in hosts.items()})


# host -> the styles that may answer it. A request to one of these hosts is answered locally: by
# the policy when its path is a model endpoint, by a stub otherwise.
HOST_STYLES: Mapping[str, tuple[Style, ...]] = _host_styles()


def route(host: str, method: str, path: str) -> tuple[Style, Endpoint] | None:
    """The style and endpoint that answer (host, method, path), if any."""
    for style in HOST_STYLES.get(host.lower(), ()):
        ep = style.endpoint(method, path)
        if ep is not None:
            return style, ep
    return None


def error_style(host: str) -> Style:
    """The style an error for `host` is written in when no endpoint matched."""
    styles = HOST_STYLES.get(host.lower())
    return styles[0] if styles else anthropic

"""The API styles, one module each, and the registry that routes a request to one.

Each style module implements `base.Style` (the module is the object): its hosts and endpoints,
`parse_request` / `parse_reply` into the neutral model, `render_response` / `render_stream` back
to native JSON or SSE, `assemble` of a recorded stream, and its errors. `STYLES` lists them and
is where the type checker holds each module to the protocol; a new style is a new module added
there.

`Routes` says which styles answer which host: each style's own hosts plus the hosts the harness
recipes name (e.g. Codex's chatgpt.com), and a proxy's `--provider-host`s. Each proxy builds its
own (`Routes.build`) and hands it to what routes requests; `BUILTIN`, the one without extra
hosts, is built once at import, and no table is changed after it is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from polar_mitm.providers import anthropic, gemini, openai_chat, openai_responses
from polar_mitm.providers.base import Endpoint, Style

__all__ = [
    "BUILTIN",
    "HOST_STYLES",
    "STYLES",
    "Routes",
    "Style",
    "error_style",
    "parse_provider_host",
    "route",
]

# The order a host's styles are tried in: OpenAI's host serves Chat Completions and Responses.
_ALL: tuple[Style, ...] = (anthropic, gemini, openai_chat, openai_responses)

STYLES: Mapping[str, Style] = MappingProxyType({s.NAME: s for s in _ALL})


# A style name for --provider-host that means both OpenAI styles (the path tells them apart).
OPENAI = "openai"


def style_names(name: str) -> list[str]:
    """The styles a --provider-host or recipe style name stands for."""
    return ["openai-chat", "openai-responses"] if name == OPENAI else [name]


def _host_styles(extra: Mapping[str, str] | None = None) -> Mapping[str, tuple[Style, ...]]:
    from polar_mitm import recipes

    pairs = [(h, s) for s in _ALL for h in s.HOSTS]
    named = sorted(recipes.provider_hosts().items()) + sorted((extra or {}).items())
    pairs += [(h, STYLES[n]) for h, name in named for n in style_names(name) if n in STYLES]
    hosts: dict[str, list[Style]] = {}
    for host, style in pairs:
        styles = hosts.setdefault(host.lower(), [])
        if style not in styles:
            styles.append(style)
    return MappingProxyType({h: tuple(sorted(ss, key=_ALL.index)) for h, ss in hosts.items()})


def parse_provider_host(spec: str) -> tuple[str, str]:
    """`HOST=STYLE` (--provider-host) as (host, style name); ValueError saying what is wrong."""
    host, eq, style = spec.partition("=")
    host, style = host.strip().lower(), style.strip()
    choices = sorted([*STYLES, OPENAI])
    if not eq or not host or not style:
        raise ValueError(
            f"{spec!r} is not HOST=STYLE (e.g. api.x.ai=openai); STYLE is one of {', '.join(choices)}"
        )
    if "/" in host or ":" in host or " " in host:
        raise ValueError(f"{host!r}: give a bare host name (no scheme, port or path)")
    if style not in choices:
        raise ValueError(f"{style!r} is not an API style; choose one of {', '.join(choices)}")
    return host, style


@dataclass(frozen=True, eq=False)
class Routes:
    """host -> the styles that may answer it. A request to one of these hosts is answered
    locally: by the policy when its path is a model endpoint, by a stub otherwise."""

    hosts: Mapping[str, tuple[Style, ...]]

    @classmethod
    def build(cls, extra: Mapping[str, str] | None = None) -> Routes:
        """The built-in and recipe hosts, plus `extra` (host -> style name, as --provider-host
        gives them)."""
        return cls(_host_styles(extra))

    def __contains__(self, host: object) -> bool:
        return isinstance(host, str) and host.lower() in self.hosts

    def names(self) -> set[str]:
        """Every host answered."""
        return set(self.hosts)

    def styles(self, host: str) -> tuple[Style, ...]:
        return self.hosts.get(host.lower(), ())

    def route(self, host: str, method: str, path: str) -> tuple[Style, Endpoint] | None:
        """The style and endpoint that answer (host, method, path), if any."""
        for style in self.styles(host):
            ep = style.endpoint(method, path)
            if ep is not None:
                return style, ep
        return None

    def error_style(self, host: str) -> Style:
        """The style an error for `host` is written in when no endpoint matched."""
        styles = self.styles(host)
        return styles[0] if styles else anthropic


# The routes of a proxy given no --provider-host.
BUILTIN = Routes.build()
HOST_STYLES = BUILTIN.hosts
route = BUILTIN.route
error_style = BUILTIN.error_style

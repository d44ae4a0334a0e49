"""One module per API style, each with the same two halves: parse the native request into the
neutral model, and render a neutral completion (or event stream) as native JSON or SSE.

Each module exposes: NAME, ID_PREFIX, endpoint(method, path) -> "generate" | "count_tokens" |
"models" | None, parse_request(body) -> ChatRequest, render_response(Completion) -> dict,
render_stream(events, req) -> async bytes, render_error(ProviderError) -> (status, dict),
render_stream_error(ProviderError) -> bytes, render_count(n) -> dict, render_models(names) -> dict.
"""

from __future__ import annotations

from types import ModuleType

from polar_mitm.providers import anthropic

# Provider hosts and the API styles they serve, most specific first. A request to one of these
# hosts is answered locally: by the policy when its path is a model endpoint, by a stub otherwise.
HOST_STYLES: dict[str, list[ModuleType]] = {
    "api.anthropic.com": [anthropic],
}

STYLES: dict[str, ModuleType] = {anthropic.NAME: anthropic}


def register(module: ModuleType, hosts: list[str]) -> None:
    STYLES[module.NAME] = module
    for h in hosts:
        HOST_STYLES.setdefault(h, [])
        if module not in HOST_STYLES[h]:
            HOST_STYLES[h].append(module)


def route(host: str, method: str, path: str) -> tuple[ModuleType, str] | None:
    """The style module and endpoint that answer (host, method, path), if any."""
    for module in HOST_STYLES.get(host.lower(), []):
        ep = module.endpoint(method, path)
        if ep is not None:
            return module, ep
    return None


def error_style(host: str) -> ModuleType:
    mods = HOST_STYLES.get(host.lower())
    return mods[0] if mods else anthropic

"""One module per API style, each with the same two halves: parse the native request into the
neutral model, and render a neutral completion (or event stream) as native JSON or SSE.

Each style module exposes:
  NAME, ID_PREFIX, HOSTS (the provider hosts it answers by default)
  endpoint(method, path) -> "generate" | "count_tokens" | "models" | None
  parse_request(body, **kw) -> ChatRequest     (kw: require_max_tokens for count_tokens; path when
                                                PARSE_NEEDS_PATH is true)
  render_response(Completion) -> dict          render_stream(events, req) -> async iterator of bytes
  render_error(ProviderError) -> (status, dict) render_stream_error(ProviderError) -> bytes
  render_count(n) -> dict                      render_models(names) -> dict
Modules in this package are discovered; a new style is a new file.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

# host -> style modules that may answer it (a host can serve several styles, e.g. OpenAI's
# Chat Completions and Responses). A request to one of these hosts is answered locally: by the
# policy when its path is a model endpoint, by a stub otherwise.
HOST_STYLES: dict[str, list[ModuleType]] = {}
STYLES: dict[str, ModuleType] = {}


def register(module: ModuleType, hosts: list[str]) -> None:
    STYLES[module.NAME] = module
    for h in hosts:
        mods = HOST_STYLES.setdefault(h.lower(), [])
        if module not in mods:
            mods.append(module)


def _discover() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "NAME") and hasattr(module, "endpoint"):
            register(module, list(getattr(module, "HOSTS", [])))


def route(host: str, method: str, path: str) -> tuple[ModuleType, str] | None:
    """The style module and endpoint that answer (host, method, path), if any."""
    for module in HOST_STYLES.get(host.lower(), []):
        ep = module.endpoint(method, path)
        if ep is not None:
            return module, ep
    return None


def error_style(host: str) -> ModuleType:
    mods = HOST_STYLES.get(host.lower())
    return mods[0] if mods else STYLES["anthropic"]


_discover()

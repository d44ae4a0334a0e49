"""Credential removal: nothing secret ever reaches the store or a log."""

from __future__ import annotations

import re
from collections.abc import Iterable

SECRET_HEADERS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "x-goog-api-key",
        "api-key",
        "cookie",
        "set-cookie",
        "x-auth-token",
        "openai-organization",
        "openai-project",
        "chatgpt-account-id",
    }
)
SECRET_PARAMS = ("key", "api_key", "apikey", "access_token", "token", "auth", "signature", "sig")
_PARAM_RE = re.compile(r"([?&](?:" + "|".join(SECRET_PARAMS) + r")=)[^&#]*", re.IGNORECASE)
REDACTED = "[redacted]"


def headers(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in items:
        lk = k.lower()
        if lk.startswith("x-polar-"):
            continue
        out[lk] = REDACTED if lk in SECRET_HEADERS or "secret" in lk or "token" in lk else v
    return out


def url(u: str) -> str:
    return _PARAM_RE.sub(lambda m: m.group(1) + REDACTED, u)


def env_values(env: dict[str, str]) -> dict[str, str]:
    """An environment with its names kept and every value redacted (`rollout --env KEY=VALUE`
    is how users pass credentials to harnesses: the store keeps only which ones were given)."""
    return {k: REDACTED for k in env}

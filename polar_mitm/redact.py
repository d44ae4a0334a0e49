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
    """Headers as stored: names lowercased, x-polar-* dropped, credentials redacted; a header
    sent more than once keeps every value, joined by ", " in the order sent."""
    out: dict[str, str] = {}
    for k, v in items:
        lk = k.lower()
        if lk.startswith("x-polar-"):
            continue
        v = REDACTED if lk in SECRET_HEADERS or "secret" in lk or "token" in lk else v
        out[lk] = f"{out[lk]}, {v}" if lk in out and v != REDACTED else v
    return out


def url(u: str) -> str:
    return _PARAM_RE.sub(lambda m: m.group(1) + REDACTED, u)


# Flag names whose value is a credential (`--api-key K`, `--token=K`, `--auth-token K`).
_SECRET_FLAG = re.compile(
    r"^--?[\w-]*(?:key|token(?!s)|secret|password|passwd|credential|auth(?!or)|bearer)[\w-]*$", re.I
)
# Values that are credentials whatever flag carries them: provider key prefixes, bearer tokens.
_SECRET_VALUE = re.compile(
    r"\b(?:sk-[\w-]{8,}|sk_[\w-]{8,}|AIza[\w-]{20,}|gh[pousr]_\w{16,}|github_pat_\w{16,}|hf_\w{16,}"
    r"|xai-[\w-]{16,}|glpat-[\w-]{16,}|AKIA[0-9A-Z]{16}|(?i:bearer)\s+[\w.~+/=-]{8,})"
)
# `NAME=value` arguments (`env OPENAI_API_KEY=... cmd`) whose name says it holds a secret.
_SECRET_ASSIGNMENT = re.compile(r"^([A-Za-z_][\w]*(?:KEY|TOKEN|SECRET|PASSWORD|CREDENTIALS?)[\w]*=).+$", re.I)


def argv(args: Iterable[str], secret_flags: Iterable[str] = ()) -> list[str]:
    """A command line with its credentials replaced by REDACTED: the values of flags whose name
    says they hold one (and of `secret_flags`, a recipe's own short names such as `-k`), header
    arguments whose header is secret (`-H 'x-api-key: K'`), `NAME=value` assignments of secret
    names, URL parameters (`?key=`), and anything shaped like a provider key wherever it is."""
    extra = set(secret_flags)
    out: list[str] = []
    hide_next = False
    for a in args:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        flag, eq, value = a.partition("=")
        if a.startswith("-") and (_SECRET_FLAG.match(flag) or flag in extra):
            if eq:
                out.append(f"{flag}={REDACTED}")
            else:
                out.append(a)
                hide_next = True
            continue
        name, colon, _ = a.partition(":")
        if colon and name.strip().lower() in SECRET_HEADERS:
            out.append(f"{name}: {REDACTED}")
            continue
        a = _SECRET_ASSIGNMENT.sub(lambda m: m.group(1) + REDACTED, a)
        out.append(_SECRET_VALUE.sub(REDACTED, url(a)))
    return out


def env_values(env: dict[str, str]) -> dict[str, str]:
    """An environment with its names kept and every value redacted (`rollout --env KEY=VALUE`
    is how users pass credentials to harnesses: the store keeps only which ones were given)."""
    return {k: REDACTED for k in env}

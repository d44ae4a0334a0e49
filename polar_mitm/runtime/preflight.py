"""Checks before anything starts: is the policy backend there, and does the tokenizer load?

Without them a wrong `--backend` or `--tokenizer` shows up minutes later, as a harness retrying
overloaded errors and blaming its provider. `run` and `proxy` call `check_policy` first (and
`rollout` can too); each failure is a `PreflightError` whose text is one line saying what is wrong
and what to do.
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from polar_mitm.backends.policy import PolicyConfig
from polar_mitm.backends.sglang import ModelInfo
from polar_mitm.backends.tokenizer import Tokenizer

EXIT_CONFIG = 78  # EX_CONFIG: the backend or the tokenizer is not usable; nothing was started
BUILD_HINT = "build one with `polar-mitm tokenizer build --kind qwen --out {dir}`"


class PreflightError(Exception):
    """What is wrong with the policy's configuration, in one line a user can act on."""


def check_backend_url(url: str) -> str:
    """The URL without a trailing slash; PreflightError when it is not an http(s) URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        if "://" not in url:
            raise PreflightError(f"--backend {url!r} has no scheme: pass http://{url}")
        raise PreflightError(f"--backend {url!r} is not an http:// or https:// URL")
    return url.rstrip("/")


def check_tokenizer_dir(path: str, source: str = "--tokenizer") -> Path:
    """The directory (expanded); PreflightError when it is missing or holds no tokenizer.json."""
    p = Path(os.path.expanduser(path))
    if p.is_file() and p.name == "tokenizer.json":
        p = p.parent
    if not p.exists():
        raise PreflightError(
            f"no tokenizer directory {path} ({source}): {BUILD_HINT.format(dir=path)}, "
            "or pass a model's own directory (polar-mitm reads local directories only)"
        )
    if not p.is_dir():
        raise PreflightError(f"{source} {path} is a file, not a tokenizer directory")
    if not (p / "tokenizer.json").is_file():
        raise PreflightError(
            f"{source} {path} has no tokenizer.json: pass a Hugging Face tokenizer directory "
            f"(a model's own, or {BUILD_HINT.format(dir=path)})"
        )
    return p


async def load_tokenizer(path: str, source: str = "--tokenizer") -> Tokenizer:
    """Load (and cache, for the policy to reuse) the tokenizer in `path`."""
    p = check_tokenizer_dir(path, source)
    try:
        return await asyncio.to_thread(Tokenizer.load, p)
    except Exception as e:  # a broken tokenizer.json, a template that does not compile, …
        raise PreflightError(f"cannot load the tokenizer in {path} ({source}): {e}") from None


async def _get_json(http: aiohttp.ClientSession, base: str, path: str, timeout: float) -> dict | None:
    """GET base+path: the JSON body (None when not JSON); PreflightError for anything else."""
    try:
        async with http.get(base + path) as r:
            if r.status == 404:
                hint = (
                    f"pass the server's root without /v1 (--backend {base[: -len('/v1')]})"
                    if base.endswith("/v1")
                    else "is --backend an SGLang server's root URL?"
                )
                raise PreflightError(f"the policy backend at {base} answered 404 for {path}: {hint}")
            if r.status != 200:
                text = (await r.text())[:120].strip()
                still = " (still starting?)" if r.status == 503 else ""
                raise PreflightError(
                    f"the policy backend at {base} answered {r.status} for {path}{still}: {text!r}"
                )
            try:
                data = await r.json(content_type=None)
            except ValueError:
                return None
            return data if isinstance(data, dict) else None
    except aiohttp.ClientConnectorError as e:
        os_error = e.os_error
        why = (
            "connection refused"
            if getattr(os_error, "errno", None) == errno.ECONNREFUSED
            else (getattr(os_error, "strerror", None) or str(os_error) or e.__class__.__name__)
        )
        raise PreflightError(
            f"cannot reach the policy backend at {base}: {why} — is the SGLang server running? "
            "(--backend or POLAR_MITM_BACKEND; `polar-mitm fake-backend` starts a fake one)"
        ) from None
    except TimeoutError:
        raise PreflightError(
            f"the policy backend at {base} did not answer {path} within {timeout:g}s"
        ) from None
    except aiohttp.ClientError as e:
        raise PreflightError(
            f"the policy backend at {base} did not answer {path} as an HTTP server would: "
            f"{e.__class__.__name__}: {e}"
        ) from None


async def check_policy(config: PolicyConfig, *, timeout: float = 5.0) -> ModelInfo:
    """Raise PreflightError unless the backend answers /health and /model_info and the tokenizer
    (`config.tokenizer`, else the backend's `tokenizer_path`) loads; return the model info.

    Checks the local things first (the URL's shape, the tokenizer directory), so a typo costs no
    network wait. In chat backend mode a server without /model_info (vLLM) is accepted.
    """
    base = check_backend_url(config.backend_url)
    if config.tokenizer:
        check_tokenizer_dir(config.tokenizer)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        await _get_json(http, base, "/health", timeout)
        try:
            data = await _get_json(http, base, "/model_info", timeout)
        except PreflightError:
            if config.backend_mode != "chat":
                raise
            data = {}
    if data is None:
        raise PreflightError(f"the policy backend at {base} answered /model_info with no JSON object")
    try:
        info = ModelInfo.model_validate(data)
    except ValueError as e:
        raise PreflightError(f"the policy backend at {base} sent an unreadable /model_info: {e}") from None
    if config.tokenizer:
        await load_tokenizer(config.tokenizer)
    elif config.backend_mode != "chat":
        path = info.tokenizer_path
        if not path or not Path(path).is_dir():
            raise PreflightError(
                f"the policy backend reports tokenizer_path={path!r}, which is not a directory here: "
                f"pass --tokenizer DIR ({BUILD_HINT.format(dir='DIR')}, or the model's own directory)"
            )
        await load_tokenizer(path, "the backend's tokenizer_path")
    return info

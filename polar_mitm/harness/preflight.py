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
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from polar_mitm.backends import logprobs
from polar_mitm.backends.engine_api import ModelInfo, NoWorkers
from polar_mitm.backends.engine_client import EngineClient
from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.neutral import ProviderError
from polar_mitm.policy import PolicyConfig

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


def _say(line: str) -> None:
    print(f"polar-mitm: {line}", file=sys.stderr, flush=True)


async def discover(
    config: PolicyConfig,
    urls: list[str],
    *,
    timeout: float,
    progress: Callable[[str], None] = _say,
) -> ModelInfo:
    """The model info of the front at `urls[0]` (`EngineClient.model_info`: an engine, or a
    router and one of its workers), waiting up to `config.backend_wait` seconds, with one line
    of progress, while a router has no worker yet."""
    client = EngineClient(urls[0], timeout=timeout, api_key=config.backend_api_key, kind=config.backend_kind)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.backend_wait
    told = False
    try:
        while True:
            try:
                return await client.model_info()
            except NoWorkers:
                if loop.time() >= deadline:
                    raise PreflightError(
                        f"the router at {urls[0]} has no worker after {config.backend_wait:g} s "
                        "(--backend-wait): start its engines or add them (POST /workers)"
                    ) from None
                if not told:
                    progress(
                        f"the router at {urls[0]} has no worker yet; waiting up to "
                        f"{config.backend_wait:g} s (--backend-wait) for one to register"
                    )
                    told = True
                await asyncio.sleep(min(1.0, max(0.0, deadline - loop.time())))
            except ProviderError as e:
                if config.backend_mode == "chat":  # a server without /model_info (vLLM) serves chat
                    return ModelInfo()
                raise PreflightError(e.message) from None
    finally:
        await client.close()


def _check_vllm_logprobs(mode: str | None, progress: Callable[[str], None]) -> None:
    """vLLM's `--logprobs-mode`: logits are refused, the raw distribution's logprobs said once."""
    if mode == "logits":
        raise PreflightError(
            "the vLLM engine reports logits, not logprobs (--logprobs-mode raw_logits or processed_logits): "
            f"restart it with {logprobs.VLLM_FLAG}"
        )
    if mode == "raw":
        progress(
            "vLLM reports the model's logprobs before temperature and top-k/top-p (--logprobs-mode "
            "raw_logprobs, its default): a turn sampled at another temperature or with top-p stores "
            f"another distribution's logprobs (recorded per turn); restart it with {logprobs.VLLM_FLAG}"
        )


async def check_policy(
    config: PolicyConfig, *, timeout: float = 5.0, progress: Callable[[str], None] = _say
) -> ModelInfo:
    """Raise PreflightError unless every backend answers /health, the front serves model info
    (`discover`) and the tokenizer (`config.tokenizer`, else the backend's `tokenizer_path`)
    loads; return the model info. A router, or several engines, is named in one line.

    Checks the local things first (the URL's shape, the tokenizer directory), so a typo costs no
    network wait. In chat backend mode a server without /model_info (vLLM) is accepted.
    """
    urls = [check_backend_url(u) for u in config.backend_urls] or [check_backend_url(config.backend_url)]
    if config.tokenizer:
        check_tokenizer_dir(config.tokenizer)
    auth = {"Authorization": f"Bearer {config.backend_api_key}"} if config.backend_api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout), headers=auth) as http:
        for base in urls:
            await _get_json(http, base, "/health", timeout)
    info = await discover(config, urls, timeout=timeout, progress=progress)
    if len(urls) > 1:
        progress(f"{len(urls)} engines (--backend given {len(urls)} times); {info.describe()} at {urls[0]}")
    elif info.front != "sglang":  # a router, or vLLM
        progress(f"{urls[0]} is {info.describe()}")
    if info.front == "vllm" and config.backend_mode != "chat":
        _check_vllm_logprobs(info.logprobs_mode, progress)
    if info.context_length is None and config.context_length is None and config.backend_mode != "chat":
        progress("the backend reports no context length; pass --context-length to bound the prompts")
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

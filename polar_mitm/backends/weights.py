"""New weights into a running engine, the way an RL trainer pushes them after an optimizer step:
from a checkpoint directory on disk, named with a weight version that the turns sampled after it
record. One place for each engine's calls (the trainer bridges, the examples and the tests use it).

- **SGLang**: `POST /update_weights_from_disk {"model_path", "weight_version",
  "abort_all_requests": false}` (its reply `{"success", "message"}`); SGLang flushes its cache
  and names every later reply's `meta_info.weight_version`.
- **vLLM** (`VLLM_SERVER_DEV_MODE=1`, checked against vLLM 0.32): `POST /pause` (mode `abort`:
  the generations under way end with `finish_reason` `abort`, new ones wait), `POST
  /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path"}}` (in place, in every
  worker), `POST /reset_prefix_cache` (its cached KV was computed by the old weights), `POST
  /update_weight_version {"new_version"}` (what `GET /weight_info` says from then on), and `POST
  /resume` whatever happened before it (a paused engine serves nothing).

`EngineWeights(url, kind)` does it; `kind` "auto" asks the engine what it is the way the policy's
discovery does (`EngineClient.model_info`: SGLang's info endpoints, else vLLM's model card).
Synchronous (a trainer's callback is), over httpx."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any, Literal

import httpx

Kind = Literal["auto", "sglang", "vllm"]

log = logging.getLogger(__name__)


class WeightLoadError(RuntimeError):
    """The engine refused the weights (or a step of loading them): what it said, where."""


def engine_kind(url: str, *, api_key: str | None = None, timeout: float = 60.0) -> str:
    """The API of the engine at `url`, "vllm" or "sglang", found as the policy's discovery finds
    it (a router in front of SGLang engines is SGLang)."""
    from polar_mitm.backends.engine_client import EngineClient

    async def ask() -> str:
        client = EngineClient(url, timeout=timeout, api_key=api_key)
        try:
            return "vllm" if (await client.model_info()).front == "vllm" else "sglang"
        finally:
            await client.close()

    # A thread of its own: the caller may be inside a running event loop (a notebook).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, ask()).result()


class EngineWeights:
    """Loads checkpoints into the engine at `url` (`kind`: its API; "auto" asks it once)."""

    def __init__(
        self, url: str, kind: Kind = "auto", *, api_key: str | None = None, timeout: float = 120.0
    ) -> None:
        self.url = url.rstrip("/")
        self._kind = kind
        self.api_key = api_key
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout

    @property
    def kind(self) -> str:
        if self._kind == "auto":
            self._kind = engine_kind(self.url, api_key=self.api_key, timeout=self.timeout)  # type: ignore[assignment]
        return self._kind

    def load(self, path: str, version: str) -> dict[str, Any]:
        """Make the engine serve the weights saved in directory `path` as `version`; what it took
        (`kind`, `seconds`). Raises WeightLoadError with the engine's answer when it refuses."""
        t0 = time.perf_counter()
        kind = self.kind
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=self.timeout) as http:
            if kind == "vllm":
                self._vllm(http, path, version)
            else:
                reply = self._call(
                    http,
                    "/update_weights_from_disk",
                    {"model_path": path, "weight_version": version, "abort_all_requests": False},
                )
                if not (isinstance(reply, dict) and reply.get("success")):
                    raise WeightLoadError(
                        f"the engine at {self.url} refused the weights in {path}: {reply!r:.300}"
                    )
        return {"kind": kind, "seconds": round(time.perf_counter() - t0, 3)}

    def version(self) -> str | None:
        """The version the engine serves now (SGLang's `/model_info`, vLLM's `/weight_info`); None
        where it says none."""
        path = "/weight_info" if self.kind == "vllm" else "/model_info"
        r = httpx.get(self.url + path, headers=self.headers, timeout=self.timeout)
        if r.status_code != 200:
            return None
        version = r.json().get("weight_version")
        return version if isinstance(version, str) else None

    def _vllm(self, http: httpx.Client, path: str, version: str) -> None:
        self._call(http, "/pause", {})
        try:
            self._call(
                http, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}
            )
            self._call(http, "/reset_prefix_cache", {})
            self._call(http, "/update_weight_version", {"new_version": version})
        except WeightLoadError:
            try:  # resumed on the weights it has: a paused vLLM holds every request
                self._call(http, "/resume", {})
            except WeightLoadError as e:
                log.error("%s; vLLM at %s stays paused", e, self.url)
            raise
        self._call(http, "/resume", {})

    def _call(self, http: httpx.Client, path: str, body: dict[str, Any]) -> Any:
        try:
            r = http.post(path, json=body)
        except httpx.HTTPError as e:
            raise WeightLoadError(f"the engine at {self.url} did not answer POST {path}: {e}") from e
        if r.status_code == 404 and path != "/update_weights_from_disk":
            raise WeightLoadError(
                f"the engine at {self.url} serves no POST {path} (404): start vLLM with "
                "VLLM_SERVER_DEV_MODE=1 for its weight-reload endpoints"
            )
        if r.status_code != 200:
            raise WeightLoadError(
                f"the engine at {self.url} answered POST {path} with HTTP {r.status_code}: {r.text[:300]}"
            )
        try:
            return r.json() if r.content else None
        except ValueError:
            return r.text

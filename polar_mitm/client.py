"""The trainer's side of the rollout service: submit tasks, get scored groups back.

```python
from polar_mitm.client import RolloutClient
client = RolloutClient("http://127.0.0.1:8700")
for group in client.rollout(tasks, samples=8, harness="claude-code"):   # groups as they complete
    for s in group.samples:
        s.tokens, s.loss_mask, s.rollout_logprobs, s.reward, s.status, s.weight_versions
```

`tasks` are `Task` objects, task paths the server can read (Harbor directories, task files:
the server needs `--task-root` for them) or TaskRequest dicts. `RolloutClient` is synchronous,
`AsyncRolloutClient` the same over asyncio. Both only speak HTTP (httpx): a trainer imports no
proxy, no store and no PyTorch.

The control token is found as `submit` finds it: `token=`, `POLAR_MITM_SERVICE_TOKEN`, or the
file `serve` writes (`token_file=`, `POLAR_MITM_SERVICE_TOKEN_FILE`, or
~/.config/polar-mitm/service-token).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from polar_mitm.api import SampleView, Submitted, TaskRequest, TaskView
from polar_mitm.auth import find_token
from polar_mitm.outcomes import TRAINABLE
from polar_mitm.strategies import Normalize
from polar_mitm.tasks.model import Task


class RolloutError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass
class Sample:
    """One trajectory row of a sample, in the shape trainers use (slime's Sample fields): made
    here from a `/results` row, not a wire model. A sample's status and outcome are the wire
    model `api.SampleView` (`Group.outcomes`).

    `tokens` is prompt + response; `loss_mask` and `rollout_logprobs` cover the response only
    (`response_length` tokens). `remove_sample` is True for samples that must not be trained
    (failed, cancelled); their mask is already all 0."""

    index: int
    group_index: int
    task_id: str
    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    reward: float | None
    status: str
    weight_versions: list[str]
    advantage: float | None = None
    remove_sample: bool = False
    trajectory_id: str = ""
    session_id: str = ""
    num_turns: int = 0
    finish_reason: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    # Which agent of the sample the row is (reconstruct/structure.py): main | subagent | compaction | side.
    role: str = "main"

    @property
    def prompt_ids(self) -> list[int]:
        return self.tokens[: len(self.tokens) - self.response_length]

    @property
    def response_ids(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.response_length :]

    @classmethod
    def from_row(cls, row: dict[str, Any], group_index: int = 0) -> Sample:
        meta = json.loads(row.get("metadata") or "{}")
        status = row.get("status") or "completed"
        return cls(
            index=row.get("sample_index") or 0,
            group_index=group_index,
            task_id=row.get("task_id") or row.get("group_id") or "",
            tokens=list(row["prompt_ids"]) + list(row["response_ids"]),
            response_length=len(row["response_ids"]),
            loss_mask=list(row["loss_mask"]),
            rollout_logprobs=list(row["response_logprobs"]),
            reward=row.get("reward"),
            status=status,
            weight_versions=[str(v) for v in meta.get("weight_versions") or [] if v is not None],
            advantage=row.get("advantage"),
            remove_sample=status not in TRAINABLE or "masked" in meta,
            trajectory_id=row["trajectory_id"],
            session_id=row["session_id"],
            num_turns=row.get("num_turns") or 0,
            finish_reason=row.get("finish_reason") or "",
            metadata=meta,
            role=row.get("role") or "main",
        )


@dataclass
class Group:
    """The samples of one task (GRPO's group), in sample order."""

    task_id: str
    state: str
    samples: list[Sample]
    index: int = 0
    # Every sample's outcome (also those with no rows: a harness that never called the model).
    outcomes: list[SampleView] = field(default_factory=list)

    @property
    def rewards(self) -> list[float | None]:
        return [s.reward for s in self.samples]


def _request(
    task: Task | str | Path | dict[str, Any] | TaskRequest,
    samples: int,
    harness: str | None,
    opts: dict[str, Any],
) -> TaskRequest:
    if isinstance(task, TaskRequest):
        return task
    if isinstance(task, dict):
        return TaskRequest.model_validate({"num_samples": samples, "harness": harness, **opts, **task})
    fields: dict[str, Any] = {"num_samples": samples, "harness": harness, **opts}
    if isinstance(task, Task):
        fields["task"] = task
    else:
        fields["task_path"] = str(Path(task).resolve())
    return TaskRequest.model_validate(fields)


def _group(data: dict[str, Any], index: int, view: TaskView) -> Group:
    rows = sorted(data["rows"], key=lambda r: r.get("sample_index") or 0)
    return Group(
        task_id=data["task_id"],
        state=data["state"],
        samples=[Sample.from_row(r, index) for r in rows],
        index=index,
        outcomes=view.samples,
    )


def _auth(token: str | None, token_file: str | Path | None) -> dict[str, str]:
    token = find_token(token, token_file)
    return {"authorization": f"Bearer {token}"} if token else {}


def _raise(r: httpx.Response) -> None:
    if r.status_code >= 400:
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = r.text[:500]
        raise RolloutError(r.status_code, msg)


class RolloutClient:
    def __init__(
        self,
        url: str = "http://127.0.0.1:8700",
        *,
        token: str | None = None,
        token_file: str | Path | None = None,
        timeout: float = 60.0,
    ):
        headers = _auth(token, token_file)
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self,
        task: Task | str | Path | dict[str, Any] | TaskRequest,
        *,
        samples: int = 1,
        harness: str | None = None,
        **opts: Any,
    ) -> str:
        """Submit one task; returns its id. opts: any TaskRequest field (runtime, priority, …)."""
        req = _request(task, samples, harness, opts)
        r = self.http.post(
            "/v1/tasks",
            content=req.model_dump_json(exclude_none=True),
            headers={"content-type": "application/json"},
        )
        _raise(r)
        return Submitted.model_validate(r.json()).task_id

    def status(self, task_id: str) -> TaskView:
        r = self.http.get(f"/v1/tasks/{task_id}")
        _raise(r)
        return TaskView.model_validate(r.json())

    def results(
        self, task_id: str, *, normalize: str = Normalize.STD, index: int = 0, view: TaskView | None = None
    ) -> Group:
        """The group's rows; `view` is a finished task's status when the caller has it already."""
        r = self.http.get(f"/v1/tasks/{task_id}/results", params={"normalize": normalize})
        _raise(r)
        return _group(r.json(), index, view or self.status(task_id))

    def parquet(self, task_id: str, *, normalize: str = Normalize.STD) -> bytes:
        r = self.http.get(
            f"/v1/tasks/{task_id}/results", params={"format": "parquet", "normalize": normalize}
        )
        _raise(r)
        return r.content

    def cancel(self, task_id: str) -> TaskView:
        r = self.http.delete(f"/v1/tasks/{task_id}")
        _raise(r)
        return TaskView.model_validate(r.json())

    def pause(self, timeout: float = 60.0) -> dict[str, Any]:
        r = self.http.post("/v1/admin/pause", json={"timeout_seconds": timeout}, timeout=timeout + 30)
        _raise(r)
        return r.json()

    def resume(self, weight_version: str | None = None) -> dict[str, Any]:
        r = self.http.post("/v1/admin/resume", json={"weight_version": weight_version})
        _raise(r)
        return r.json()

    def wait(
        self, task_ids: Iterable[str], *, poll: float = 1.0, timeout: float | None = None
    ) -> Iterator[Group]:
        """Groups as their tasks finish (done or cancelled), in the order they finish."""
        pending = {t: i for i, t in enumerate(task_ids)}
        deadline = time.monotonic() + timeout if timeout else None
        while pending:
            for task_id, index in list(pending.items()):
                view = self.status(task_id)
                if view.state in ("done", "cancelled"):
                    del pending[task_id]
                    yield self.results(task_id, index=index, view=view)
            if pending:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{len(pending)} tasks unfinished after {timeout} s")
                time.sleep(poll)

    def rollout(
        self,
        tasks: Iterable[Task | str | Path | dict[str, Any]],
        *,
        samples: int,
        harness: str | None = None,
        poll: float = 1.0,
        **opts: Any,
    ) -> Iterator[Group]:
        """Submit every task and yield its group as soon as it is complete."""
        ids = [self.submit(t, samples=samples, harness=harness, **opts) for t in tasks]
        yield from self.wait(ids, poll=poll)


class AsyncRolloutClient:
    def __init__(
        self,
        url: str = "http://127.0.0.1:8700",
        *,
        token: str | None = None,
        token_file: str | Path | None = None,
        timeout: float = 60.0,
    ):
        headers = _auth(token, token_file)
        self.http = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def submit(
        self,
        task: Task | str | Path | dict[str, Any] | TaskRequest,
        *,
        samples: int = 1,
        harness: str | None = None,
        **opts: Any,
    ) -> str:
        req = _request(task, samples, harness, opts)
        r = await self.http.post(
            "/v1/tasks",
            content=req.model_dump_json(exclude_none=True),
            headers={"content-type": "application/json"},
        )
        _raise(r)
        return Submitted.model_validate(r.json()).task_id

    async def status(self, task_id: str) -> TaskView:
        r = await self.http.get(f"/v1/tasks/{task_id}")
        _raise(r)
        return TaskView.model_validate(r.json())

    async def results(
        self, task_id: str, *, normalize: str = Normalize.STD, index: int = 0, view: TaskView | None = None
    ) -> Group:
        r = await self.http.get(f"/v1/tasks/{task_id}/results", params={"normalize": normalize})
        _raise(r)
        return _group(r.json(), index, view or await self.status(task_id))

    async def parquet(self, task_id: str, *, normalize: str = "std") -> bytes:
        r = await self.http.get(
            f"/v1/tasks/{task_id}/results", params={"format": "parquet", "normalize": normalize}
        )
        _raise(r)
        return r.content

    async def cancel(self, task_id: str) -> TaskView:
        r = await self.http.delete(f"/v1/tasks/{task_id}")
        _raise(r)
        return TaskView.model_validate(r.json())

    async def pause(self, timeout: float = 60.0) -> dict[str, Any]:
        r = await self.http.post("/v1/admin/pause", json={"timeout_seconds": timeout}, timeout=timeout + 30)
        _raise(r)
        return r.json()

    async def resume(self, weight_version: str | None = None) -> dict[str, Any]:
        r = await self.http.post("/v1/admin/resume", json={"weight_version": weight_version})
        _raise(r)
        return r.json()

    async def wait(
        self, task_ids: Iterable[str], *, poll: float = 1.0, timeout: float | None = None
    ) -> AsyncIterator[Group]:
        pending = {t: i for i, t in enumerate(task_ids)}
        deadline = time.monotonic() + timeout if timeout else None
        while pending:
            for task_id, index in list(pending.items()):
                view = await self.status(task_id)
                if view.state in ("done", "cancelled"):
                    del pending[task_id]
                    yield await self.results(task_id, index=index, view=view)
            if pending:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{len(pending)} tasks unfinished after {timeout} s")
                await asyncio.sleep(poll)

    async def rollout(
        self,
        tasks: Iterable[Task | str | Path | dict[str, Any]],
        *,
        samples: int,
        harness: str | None = None,
        poll: float = 1.0,
        **opts: Any,
    ) -> AsyncIterator[Group]:
        ids = [await self.submit(t, samples=samples, harness=harness, **opts) for t in tasks]
        async for g in self.wait(ids, poll=poll):
            yield g

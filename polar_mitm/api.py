"""The rollout service's HTTP contract: every body that crosses it, as pydantic models.

`/openapi.json` is built from these (`service/openapi.py`), and the client, the nodes and the
server all import them, so the three cannot disagree. Every field a client sends is bounded here
(numbers, lengths, ids), so a hostile body is a 422 naming its field, never a 500 or a value that
breaks a loop later; the body's size and depth are bounded before parsing (`service/http.py`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from polar_mitm.outcomes import FINAL
from polar_mitm.strategies import Strategy
from polar_mitm.tasks.model import RUNTIMES, EvaluatorSpec, Task

TASK_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,199}")


def _safe_id(v: str) -> str:
    if not TASK_ID.fullmatch(v):
        raise ValueError(
            f"ids are letters, digits and . _ : @ + - (they appear in URLs), at most 200; got {v[:80]!r}"
        )
    return v


# Task, node, session ids and leases: safe in a URL path and a file name (no `/`).
Id = Annotated[str, AfterValidator(_safe_id)]
WEEK = 7 * 24 * 3600.0
Seconds = Annotated[float, Field(gt=0, le=WEEK, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0, le=1_000_000_000)]
Text = Annotated[str, StringConstraints(max_length=10_000)]
Short = Annotated[str, StringConstraints(max_length=200)]
SampleState = Literal["queued", "dispatched", "cancelling", "finished"]
TaskState = Literal["queued", "running", "done", "cancelled"]


class BoundedEvaluator(EvaluatorSpec):
    """The evaluator as a client may send it: its numbers bounded."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    timeout_sec: Seconds = 600.0


class BoundedTask(Task):
    """A task as a client may send it: its numbers bounded (the loaders' own `Task` is the
    operator's, and unbounded)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    cpus: float | None = Field(None, gt=0, le=4096)
    memory_mb: int | None = Field(None, ge=1, le=1 << 30)
    agent_timeout_sec: Seconds = 600.0
    total_timeout_sec: Seconds | None = None
    evaluator: BoundedEvaluator = Field(default_factory=BoundedEvaluator)


class TaskRequest(BaseModel):
    """One task to roll out `num_samples` times. The task is given inline (`task`), or as a path
    the server and its nodes can read (`task_path`: a Harbor directory, or a task file with
    `task_id` choosing one of its tasks)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    task_id: str | None = Field(None, description="The id for this request [default: the task's id]")
    task: BoundedTask | None = None
    task_path: str | None = Field(None, max_length=4096)
    num_samples: int = Field(1, ge=1, le=1024)
    # Any name: the server knows which harnesses its nodes run (a 422 names them), not the client.
    harness: str = Field(
        min_length=1,
        max_length=200,
        description="A recipe name, e.g. claude-code (`polar-mitm recipes` lists them); the server checks it",
    )
    harness_cmd: list[Text] | None = Field(None, max_length=1000)
    runtime: str = "docker"
    evaluator: BoundedEvaluator | None = Field(None, description="Replaces the task's evaluator")
    builder: Strategy = Strategy.PREFIX_MERGE
    priority: int = Field(0, ge=-1_000_000, le=1_000_000, description="Higher runs first")
    early_stop_min_usable: int | None = Field(None, ge=1, le=1024)
    timeout_seconds: Seconds | None = Field(None, description="Per sample: sandbox start to score")
    agent_timeout_seconds: Seconds | None = None
    max_staleness: int | None = Field(
        None, ge=0, le=1_000_000, description="Most weight-version changes a sample's turns may span"
    )
    stale_action: Literal["flag", "mask"] = "flag"
    callback_url: str | None = Field(None, max_length=2048)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("task", "evaluator", mode="before")
    @classmethod
    def _bound(cls, v: Any) -> Any:
        # A loader's Task (or EvaluatorSpec) is checked against the bounds like any dict.
        return (
            v.model_dump()
            if isinstance(v, Task | EvaluatorSpec) and not isinstance(v, BoundedTask | BoundedEvaluator)
            else v
        )

    @field_validator("task_id")
    @classmethod
    def _path_safe(cls, v: str | None) -> str | None:
        if v is not None and not TASK_ID.fullmatch(v):
            raise ValueError(
                f"task ids are letters, digits and . _ : - (they appear in URLs); got {v[:80]!r}"
            )
        return v

    @field_validator("runtime")
    @classmethod
    def _known_runtime(cls, v: str) -> str:
        if v not in RUNTIMES:
            raise ValueError(f"unknown runtime {v!r}; known: {', '.join(RUNTIMES)}")
        return v

    @field_validator("callback_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"callback_url must be an http(s) URL, got {v!r}")
        return v

    @model_validator(mode="after")
    def _one_task(self) -> TaskRequest:
        if (self.task is None) == (self.task_path is None):
            raise ValueError("give exactly one of task (inline) or task_path")
        return self


class Submitted(BaseModel):
    task_id: str
    num_samples: int
    state: TaskState = "queued"


class SampleView(BaseModel):
    """The service's one model of a sample for a trainer: its state and outcome within a task
    (`TaskView.samples`, `client.Group.outcomes`). The rows are fetched apart (`/results`)."""

    index: int
    state: SampleState
    stage: str | None = None
    status: str | None = None
    cause: str | None = None
    node_id: str | None = None
    dispatches: int = 0
    reward: float | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    weight_versions: list[str] = Field(default_factory=list)
    session_id: str | None = None


class TaskView(BaseModel):
    task_id: str
    state: TaskState
    num_samples: int
    priority: int
    harness: str
    runtime: str
    created_at: float
    updated_at: float
    samples: list[SampleView]
    callback: str | None = None


class Assignment(BaseModel):
    """A sample a node is to run, under a lease."""

    task_id: str
    index: int
    lease: str
    task: Task
    harness: str
    harness_cmd: list[str] | None = None
    runtime: str
    builder: Strategy
    num_samples: int
    agent_timeout_seconds: float | None = None
    timeout_seconds: float | None = None


class Control(BaseModel):
    """What the server tells a node on every heartbeat and lease."""

    paused: bool = False
    weight_version: str | None = None
    cancel: list[tuple[str, int]] = Field(default_factory=list)  # (task_id, index) to stop
    draining: bool = False
    # Leases the node listed that are no longer its (it was declared lost, or the sample was
    # repaired): it stops those copies and reports nothing of them.
    drop: list[str] = Field(default_factory=list)


class Registered(Control):
    """The reply to a registration: the server's switches, and this node's own key (its bearer
    token for heartbeats, leases and results from now on)."""

    node_key: str


class NodeRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node_id: Id
    url: str | None = Field(None, max_length=2048)
    workers: dict[Short, Count] = Field(default_factory=dict, max_length=32)  # init / run / postrun / ready


class StageLoad(BaseModel):
    model_config = ConfigDict(extra="forbid")

    queued: Count = 0
    in_flight: Count = 0


class Heartbeat(BaseModel):
    """A node's load: per stage its queue depth and in-flight count, plus its proxy's state."""

    model_config = ConfigDict(extra="forbid")

    stages: dict[Short, StageLoad] = Field(default_factory=dict, max_length=32)
    generating: Count = 0  # generations under way in the node's proxy
    paused: bool = False  # the node's proxy gate is closed
    turns: Count = 0  # turns served since the node started
    # In flight: (task, index, stage).
    samples: list[tuple[Id, Annotated[int, Field(ge=0, le=1024)], Short]] = Field(
        default_factory=list, max_length=100_000
    )
    # The leases the node holds (a sample's every copy by its own lease); None from a node that
    # keys its samples by task and index only, whose `samples` stand for them.
    leases: list[Id] | None = Field(None, max_length=100_000)


class LeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    capacity: int = Field(ge=0, le=4096)


class LeaseReply(BaseModel):
    assignments: list[Assignment] = Field(default_factory=list)
    control: Control = Field(default_factory=Control)


class SampleResult(BaseModel):
    """A node's report of one finished sample to the server (its rows built by the request's
    builder), under the sample's lease; the server keeps it as a `store.service.SampleRow` and
    shows it as a `SampleView`. Not the pipeline's in-process `rollout.pipeline.SampleOutcome`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    task_id: Id
    index: int = Field(ge=0, le=1024)
    lease: Id
    status: str
    cause: Text | None = None
    reward: float | None = Field(None, ge=-1e9, le=1e9)
    detail: dict[str, Any] | None = None
    timings: dict[Short, Annotated[float, Field(ge=0, le=10 * WEEK)]] = Field(
        default_factory=dict, max_length=64
    )
    session_id: Id | None = None
    rows: list[dict[str, Any]] = Field(default_factory=list, max_length=100_000)

    @field_validator("status")
    @classmethod
    def _an_outcome(cls, v: str) -> str:
        if v not in FINAL:
            raise ValueError(f"status is one of {', '.join(sorted(FINAL))}; got {v[:80]!r}")
        return v


class NodeView(BaseModel):
    node_id: str
    url: str | None
    state: str
    workers: dict[str, int]
    last_seen: float
    healthy: bool
    load: Heartbeat | None = None
    dispatched: int = 0


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    timeout_seconds: float = Field(60.0, ge=0, le=24 * 3600)


class PauseReply(BaseModel):
    paused: bool
    drained: bool  # every node reported no generation under way within the timeout
    generating: int
    nodes: int


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight_version: Short | None = None


class Event(BaseModel):
    """One line of `GET /v1/events`. `lost`: this subscriber read too slowly and missed
    `data.events` events before the next one (the oldest are dropped first)."""

    kind: Literal["task", "sample", "node", "weights", "lost"]
    task_id: str | None = None
    index: int | None = None
    state: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)
    at: float = 0.0

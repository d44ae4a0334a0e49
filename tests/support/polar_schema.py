"""Polar's published rollout API as its clients validate it, written here from its schemas
(NVIDIA-NeMo/ProRL-Agent-Server: polar/rollout/models.py, polar/trajectory/models.py,
polar/runtime/models.py, polar/agent/models.py), independent of the server's own mapping
(`polar_mitm/service/polar_models.py`): a reply valid here is one Polar's trainers accept.
Extras are forbidden where Polar forbids them (SessionTiming), allowed where it allows them.
"""

from __future__ import annotations

import math
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SessionStatus(StrEnum):
    REGISTERED = "REGISTERED"
    INITIALIZING = "INITIALIZING"
    READY = "READY"
    RUNNING = "RUNNING"
    POST_RUN = "POST_RUN"
    BUILDING = "BUILDING"
    EVALUATING = "EVALUATING"
    COMPLETED = "COMPLETED"
    ERROR = "ERROR"
    TIMEOUT = "TIMEOUT"


def _finite(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("reward must be numeric, not boolean")
    parsed = float(value)
    if not math.isfinite(parsed):
        raise ValueError("reward must be finite")
    return parsed


class Trace(BaseModel):
    prompt_ids: list[int] = Field(default_factory=list)
    response_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    prompt_messages: list[dict[str, Any]] = Field(default_factory=list)
    response_messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    response_logprobs: list[float] | None = None
    reward: float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("reward", mode="before")
    @classmethod
    def _reward(cls, v: Any) -> float | None:
        return _finite(v)

    @field_validator("loss_mask")
    @classmethod
    def _mask(cls, v: list[int]) -> list[int]:
        if any(int(x) not in (0, 1) for x in v):
            raise ValueError("loss_mask values must be 0 or 1")
        return v

    @model_validator(mode="after")
    def _lengths(self) -> Trace:
        if self.loss_mask and len(self.loss_mask) != len(self.response_ids):
            raise ValueError("loss_mask length must match response_ids length")
        if self.response_logprobs is not None and len(self.response_logprobs) != len(self.response_ids):
            raise ValueError("response_logprobs length must match response_ids length")
        return self


class Trajectory(BaseModel):
    status: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    traces: list[Trace] = Field(default_factory=list)
    error: str | None = None

    @field_validator("status")
    @classmethod
    def _status(cls, v: str) -> str:
        if v not in {"COMPLETED", "TIMEOUT", "ERROR"}:
            raise ValueError("status must be one of COMPLETED, ERROR, TIMEOUT")
        return v


class SessionTiming(BaseModel):
    model_config = ConfigDict(extra="forbid")

    register_to_init_queue_ms: float = 0.0
    rollout_dispatch_ms: float = 0.0
    rollout_result_wait_ms: float = 0.0
    rollout_pipeline_e2e_ms: float = 0.0
    init_ms: float = 0.0
    ready_queue_ms: float = 0.0
    run_ms: float = 0.0
    postrun_queue_ms: float = 0.0
    postrun_ms: float = 0.0
    container_start_ms: float = 0.0
    eval_container_start_ms: float = 0.0
    runtime_validation_ms: float = 0.0
    eval_runtime_validation_ms: float = 0.0
    prepare_ms: float = 0.0
    eval_prepare_ms: float = 0.0
    agent_setup_ms: float = 0.0
    agent_exec_ms: float = 0.0
    agent_postprocess_ms: float = 0.0
    build_ms: float = 0.0
    eval_ms: float = 0.0
    postrun_exec_ms: float = 0.0
    runtime_stop_ms: float = 0.0
    e2e_ms: float = 0.0
    runtime_exec_ms: float = 0.0
    runtime_exec_count: int = 0
    runtime_exec_timeout_count: int = 0
    runtime_exec_failure_count: int = 0
    runtime_exec_exception_count: int = 0
    runtime_exec_cancelled_count: int = 0
    runtime_exec_ms_by_category: dict[str, float] = Field(default_factory=dict)
    runtime_exec_count_by_category: dict[str, int] = Field(default_factory=dict)
    mini_swe_command_ms: float = 0.0
    mini_swe_command_count: int = 0
    mini_swe_command_timeout_count: int = 0
    mini_swe_command_failure_count: int = 0
    mini_swe_command_ms_by_category: dict[str, float] = Field(default_factory=dict)
    mini_swe_command_count_by_category: dict[str, int] = Field(default_factory=dict)


class SessionResult(BaseModel):
    session_id: str
    task_id: str
    status: SessionStatus
    trajectory: Trajectory
    timing: SessionTiming = Field(default_factory=SessionTiming)
    node_id: str | None = None
    error: str | None = None
    metadata: dict[str, object] = Field(default_factory=dict)


class TaskResult(BaseModel):
    task_id: str
    status: str
    results: list[SessionResult]
    result_paths: list[str] = Field(default_factory=list)


class TaskStatus(BaseModel):
    task_id: str
    status: str
    total_sessions: int
    completed_sessions: int
    results: list[SessionResult] = Field(default_factory=list)
    result_paths: list[str] = Field(default_factory=list)


class NodeStageMetrics(BaseModel):
    init_queue_depth: int = Field(default=0, ge=0)
    init_inflight: int = Field(default=0, ge=0)
    ready_depth: int = Field(default=0, ge=0)
    run_inflight: int = Field(default=0, ge=0)
    postrun_queue_depth: int = Field(default=0, ge=0)
    postrun_inflight: int = Field(default=0, ge=0)


class GatewayNodeInfo(BaseModel):
    node_id: str
    gateway_url: str
    max_init_workers: int
    max_run_workers: int
    max_postrun_workers: int
    metrics: NodeStageMetrics = Field(default_factory=NodeStageMetrics)
    dispatch_reservations: int = Field(default=0, ge=0)
    healthy: bool
    draining: bool = False
    heartbeat_interval_seconds: int
    last_heartbeat: datetime


# -- what a client sends (Polar's request models, for building payloads as its clients do) -------


class ExecInput(BaseModel):
    command: str
    cwd: str | None = None
    env: dict[str, str] | None = None


class PrepareAction(BaseModel):
    type: Literal["upload_file", "upload_dir", "exec"]
    source: str | None = None
    target: str | None = None
    command: str | None = None
    cwd: str | None = None
    env: dict[str, str] | None = None
    max_attempts: int = Field(default=1, ge=1, le=10)
    retry_backoff_seconds: float = Field(default=0.0, ge=0.0, le=60.0)


class RuntimeSpec(BaseModel):
    backend: Literal["docker", "apptainer"] = "docker"
    image: str
    prepare: list[PrepareAction] = Field(default_factory=list)
    eval_prepare: list[PrepareAction] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    network: str | None = "host"
    workdir: str | None = None
    cpus: int | None = None
    memory_mb: int | None = None
    allow_internet: bool = True
    kwargs: dict[str, Any] = Field(default_factory=dict)


class AgentSpec(BaseModel):
    harness: str | None = None
    import_path: str | None = None
    model_name: str | None = None
    settings: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    custom_shell: ExecInput | None = None


class StrategySpec(BaseModel):
    strategy: str
    config: dict[str, Any] = Field(default_factory=dict)


class EvaluatorSpec(BaseModel):
    strategy: str
    config: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    refresh_runtime: bool = False


class TaskRequest(BaseModel):
    task_id: str
    instruction: str
    num_samples: int = Field(default=1, ge=1)
    dispatch_priority: int = Field(default=0, ge=0, le=100)
    early_stop_min_usable_sessions: int | None = Field(default=None, ge=1)
    timeout_seconds: float = Field(default=600.0, gt=0)
    runtime: RuntimeSpec | None = None
    agent: AgentSpec
    builder: StrategySpec = Field(default_factory=lambda: StrategySpec(strategy="per_request"))
    evaluator: EvaluatorSpec | None = None
    callback_url: str | None = None
    metadata: dict[str, object] = Field(default_factory=dict)

    def payload(self) -> dict[str, Any]:
        """The JSON a Polar client posts: what it set, Polar's defaults left to the server."""
        return self.model_dump(mode="json", exclude_unset=True)

"""Polar's rollout API in polar-mitm's terms: Polar's `TaskRequest` as it arrives, mapped onto
ours (`api.TaskRequest`), and our tasks, samples and rows written in Polar's reply shapes
(`TaskStatus`, `SessionResult`, `SessionTiming`, `Trajectory`, `Trace`, `GatewayNodeInfo`).

The field names, types and defaults are Polar's (NVIDIA-NeMo/ProRL-Agent-Server, `polar/*/models.py`);
the routes that use this are `service/polar.py`. A request is mapped, never guessed: what
polar-mitm does differently but equivalently is recorded in the sample's metadata
(`metadata.polar_mitm.recorded`, field → what was done), and what it will not do is refused with
a 422 (or a 403 for what the operator has off) naming Polar's field. Pure functions, no I/O.
"""

from __future__ import annotations

import json
import math
import shlex
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from polar_mitm import api as m
from polar_mitm.outcomes import TRAINABLE
from polar_mitm.recipes import all_recipes
from polar_mitm.service.http import ApiError, forbid
from polar_mitm.store.service import SampleRow, TaskSummary
from polar_mitm.strategies import Strategy

# Polar's own strict models refuse an unknown key where they forbid extras; ours refuse every
# unknown key: a field polar-mitm does not know is one it would otherwise silently ignore.
STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
# Where the mapping keeps what it needs later (the callback, the echoed metadata, what it
# recorded) inside our stored request's metadata.
KEY = "polar"
# A `runtime.kwargs` key of polar-mitm's own: run on the node's host (`--allow-local-runtime`).
LOCAL_RUNTIME_KWARG = "polar_mitm_runtime"
HARBOR_DEFAULTS = {
    "tests_target": "/tests",
    "verifier_dir": "/logs/verifier",
    "test_command": "bash /tests/test.sh",
}
Str = Field(max_length=10_000)


# -- Polar's request, as it arrives -------------------------------------------------------------


class ExecInput(BaseModel):
    model_config = STRICT

    command: str = Field(max_length=100_000)
    cwd: str | None = Field(None, max_length=4096)
    env: dict[str, str] | None = None


class PrepareAction(BaseModel):
    model_config = STRICT

    type: Literal["upload_file", "upload_dir", "exec"]
    source: str | None = Field(None, max_length=4096)
    target: str | None = Field(None, max_length=4096)
    command: str | None = Field(None, max_length=100_000)
    cwd: str | None = Field(None, max_length=4096)
    env: dict[str, str] | None = None
    max_attempts: int = Field(1, ge=1, le=10)
    retry_backoff_seconds: float = Field(0.0, ge=0.0, le=60.0)

    @model_validator(mode="after")
    def _complete(self) -> PrepareAction:
        if self.type == "exec" and not self.command:
            raise ValueError("exec requires command")
        if self.type != "exec" and not (self.source and self.target):
            raise ValueError(f"{self.type} requires source and target")
        return self


# A field named `kwargs` collides with the pydantic plugin's __init__(**kwargs) for the checker only.
class RuntimeSpec(BaseModel):  # type: ignore[no-redef]
    model_config = STRICT

    backend: Literal["docker", "apptainer"] = "docker"
    image: str = Field(min_length=1, max_length=1000)
    prepare: list[PrepareAction] = Field(default_factory=list, max_length=1000)
    eval_prepare: list[PrepareAction] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    network: str | None = "host"
    workdir: str | None = Field(None, max_length=4096)
    direct_exec_init_command: str | None = None
    cpus: int | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    gpus: int = 0
    allow_internet: bool = True
    internet_volumes: list[str] = Field(default_factory=list)
    import_path: str | None = None
    kwargs: dict[str, Any] = Field(default_factory=dict)


class MCPServerSpec(BaseModel):
    model_config = STRICT

    name: str
    transport: Literal["stdio", "sse", "streamable-http"]
    command: str | None = None
    args: list[str] = Field(default_factory=list)
    url: str | None = None


class AgentSpec(BaseModel):
    model_config = STRICT

    harness: str | None = Field(None, max_length=200)
    import_path: str | None = None
    model_name: str | None = Field(None, max_length=1000)
    settings: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    mcp_servers: list[MCPServerSpec] = Field(default_factory=list)
    skills_path: str | None = None
    custom_shell: ExecInput | None = None

    @model_validator(mode="after")
    def _one_source(self) -> AgentSpec:
        if (self.harness is None) == (self.import_path is None):
            raise ValueError("exactly one of harness or import_path must be provided")
        if self.custom_shell is not None and self.harness != "shell":
            raise ValueError("custom_shell is only valid when agent.harness is 'shell'")
        if self.harness == "shell" and self.custom_shell is None:
            raise ValueError("agent.harness='shell' requires custom_shell")
        return self


class StrategySpec(BaseModel):
    model_config = STRICT

    strategy: str = Field(max_length=200)
    config: dict[str, Any] = Field(default_factory=dict)


class EvaluatorSpec(BaseModel):
    model_config = STRICT

    strategy: str = Field(max_length=200)
    config: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    refresh_runtime: bool = False


class TaskRequest(BaseModel):
    """Polar's TaskRequest (its defaults: one sample, priority 0, 600 s, the per_request builder)."""

    model_config = STRICT

    task_id: str = Field(max_length=1000)
    instruction: str = Field(min_length=1, max_length=1_000_000)
    num_samples: int = Field(1, ge=1)
    dispatch_priority: int = Field(0, ge=0, le=100)
    early_stop_min_usable_sessions: int | None = Field(None, ge=1)
    timeout_seconds: float = Field(600.0, gt=0)
    runtime: RuntimeSpec | None = None
    agent: AgentSpec
    builder: StrategySpec = Field(default_factory=lambda: StrategySpec(strategy="per_request"))
    evaluator: EvaluatorSpec | None = None
    callback_url: str | None = Field(None, max_length=2048)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _checks(self) -> TaskRequest:
        if (
            self.early_stop_min_usable_sessions is not None
            and self.early_stop_min_usable_sessions > self.num_samples
        ):
            raise ValueError("early_stop_min_usable_sessions cannot exceed num_samples")
        timeout = self.metadata.get("agent_timeout")
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not math.isfinite(float(timeout))
            or float(timeout) <= 0
        ):
            raise ValueError("metadata.agent_timeout must be a positive finite number")
        return self


# -- the mapping --------------------------------------------------------------------------------


def refuse(field: str, message: str) -> ApiError:
    """A 422 naming Polar's field: what polar-mitm will not do."""
    return ApiError(
        422, "invalid_request", f"{field}: {message}", fields=[{"field": field, "message": message}]
    )


# Our model's fields, as the Polar client wrote them (for a bound our model holds).
_OUR_FIELDS = {
    "task.instruction": "instruction",
    "task.image": "runtime.image",
    "task.workdir": "runtime.workdir",
    "task.cpus": "runtime.cpus",
    "task.memory_mb": "runtime.memory_mb",
    "task.agent_timeout_sec": "metadata.agent_timeout",
    "task.total_timeout_sec": "timeout_seconds",
    "task.evaluator.timeout_sec": "evaluator.config.verifier_timeout",
    "priority": "dispatch_priority",
    "early_stop_min_usable": "early_stop_min_usable_sessions",
    "agent_timeout_seconds": "metadata.agent_timeout",
    "harness_cmd": "agent.custom_shell.command",
}


def _shell_step(action: ExecInput | PrepareAction) -> str:
    """A command with its cwd and env, as one shell line."""
    line = action.command or ""
    if action.env:
        line = (
            " ".join(f"{k}={shlex.quote(v)}" for k, v in action.env.items()) + f" sh -c {shlex.quote(line)}"
        )
    if action.cwd:
        line = f"cd {shlex.quote(action.cwd)} && {line}"
    return line


def _prepare(actions: list[PrepareAction], task_root: Path | None) -> tuple[list[dict[str, str]], list[str]]:
    """Polar's prepare steps as our uploads (copied in first) and setup lines, in its order."""
    uploads: list[dict[str, str]] = []
    lines: list[str] = []
    for i, a in enumerate(actions):
        field = f"runtime.prepare[{i}]"
        if a.type != "exec":
            if lines:
                raise refuse(
                    field, f"{a.type} after an exec step: polar-mitm copies files in before the first"
                )
            if task_root is None:
                raise forbid(field, "the server copies no host path unless started with --task-root DIR")
            assert a.source is not None and a.target is not None
            if not Path(a.source).resolve().is_relative_to(task_root):
                raise forbid(field, f"{a.source} is outside --task-root {task_root}")
            if a.type == "upload_dir" and not Path(a.source).is_dir():
                raise refuse(field, f"{a.source} is not a directory")
            if a.type == "upload_file" and not Path(a.source).is_file():
                raise refuse(field, f"{a.source} is not a file")
            uploads.append({"source": str(Path(a.source).resolve()), "target": a.target})
            continue
        line = _shell_step(a)
        if a.max_attempts > 1:  # Polar's retries, in the shell: the last failure fails the setup
            wait = f"sleep {a.retry_backoff_seconds:g}; " if a.retry_backoff_seconds else ""
            line = (
                f"for _try in $(seq {a.max_attempts}); do ({line}) && break; "
                f"[ $_try = {a.max_attempts} ] && exit 1; {wait}done"
            )
        lines.append(line)
    return uploads, lines


def _harness(agent: AgentSpec) -> tuple[str, list[str] | None]:
    """Polar's harness name (underscores) as our recipe, and a command for `shell`."""
    if agent.import_path is not None:
        raise refuse("agent.import_path", "polar-mitm runs no Python class by import path; name a harness")
    if agent.mcp_servers:
        raise refuse("agent.mcp_servers", "polar-mitm passes no MCP servers to a harness")
    if agent.skills_path is not None:
        raise refuse("agent.skills_path", "polar-mitm copies no host skills directory into the sandbox")
    assert agent.harness is not None
    if agent.harness == "shell":
        assert agent.custom_shell is not None
        # The instruction is the command's $1; its env joins the sandbox's.
        cmd = agent.custom_shell.model_copy(update={"env": None})
        return "generic", ["sh", "-c", _shell_step(cmd), "polar-shell", "{instruction}"]
    name = agent.harness.replace("_", "-")
    known = all_recipes()
    if name not in known:
        names = ", ".join(sorted(n.replace("-", "_") for n in known))
        raise refuse("agent.harness", f"unknown harness {agent.harness[:80]!r}; known: shell, {names}")
    return name, None


def _evaluator(ev: EvaluatorSpec | None, recorded: dict[str, str], task_root: Path | None) -> dict[str, Any]:
    if ev is None:
        recorded["evaluator"] = (
            "none given: scored by session_completed (1.0 when the harness exited 0 in time)"
        )
        return {"kind": "session_completed"}
    if ev.refresh_runtime:
        recorded["evaluator.refresh_runtime"] = "the verifier always runs per the task's Harbor mode"
    if ev.strategy == "session_completed":
        if ev.config:
            raise refuse("evaluator.config", "session_completed takes no config")
        return {"kind": "session_completed", "env": ev.env}
    if ev.strategy != "harbor":
        raise refuse(
            "evaluator.strategy",
            f"{ev.strategy[:80]!r} is not one polar-mitm runs; it runs harbor, session_completed",
        )
    cfg = dict(ev.config)
    tests_dir = cfg.pop("tests_dir", None)
    if not isinstance(tests_dir, str) or not tests_dir.strip():
        raise refuse("evaluator.config.tests_dir", "harbor needs tests_dir, the task's tests/ directory")
    if task_root is None:
        raise forbid(
            "evaluator.config.tests_dir",
            "the server reads no host path unless started with --task-root DIR (the tests must lie under it)",
        )
    if not Path(tests_dir.strip()).resolve().is_relative_to(task_root):
        raise forbid("evaluator.config.tests_dir", f"{tests_dir[:200]} is outside --task-root {task_root}")
    timeout = cfg.pop("verifier_timeout", 120.0)  # Polar's default, not ours
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise refuse("evaluator.config.verifier_timeout", "a number of seconds")
    for key, default in HARBOR_DEFAULTS.items():
        if cfg.pop(key, default) != default:
            raise refuse(f"evaluator.config.{key}", f"polar-mitm runs Harbor's own layout: {default}")
    for key in ("upload_attempts", "upload_retry_backoff_seconds"):
        if key in cfg:
            cfg.pop(key)
            recorded[f"evaluator.config.{key}"] = "the tests are copied once, from a pristine read-only copy"
    if cfg:
        raise refuse(f"evaluator.config.{sorted(cfg)[0]}", "not a harbor evaluator setting")
    return {"kind": "harbor", "tests_dir": tests_dir.strip(), "timeout_sec": float(timeout), "env": ev.env}


def _runtime(
    rt: RuntimeSpec | None, recorded: dict[str, str], task_root: Path | None
) -> tuple[str, dict[str, Any]]:
    """Our runtime name and the task fields the runtime spec gives."""
    if rt is None:
        raise refuse("runtime", "polar-mitm's nodes have no default runtime: give runtime.image")
    for field, bad, why in (
        ("import_path", rt.import_path is not None, "polar-mitm runs no runtime class by import path"),
        ("eval_prepare", bool(rt.eval_prepare), "the verifier runs the task's own setup, nothing added"),
        ("direct_exec_init_command", rt.direct_exec_init_command is not None, "no direct-exec mode"),
        ("gpus", rt.gpus > 0, "polar-mitm gives a sandbox no GPU"),
        ("internet_volumes", bool(rt.internet_volumes), "polar-mitm mounts no host path into a sandbox"),
    ):
        if bad:
            raise refuse(f"runtime.{field}", why)
    runtime: str = rt.backend
    kwargs = dict(rt.kwargs)
    if LOCAL_RUNTIME_KWARG in kwargs:
        if kwargs.pop(LOCAL_RUNTIME_KWARG) != "local":
            raise refuse(f"runtime.kwargs.{LOCAL_RUNTIME_KWARG}", "the only value is 'local'")
        runtime = "local"
        recorded["runtime.backend"] = "local: the harness runs on the node's host (the server allows it)"
    if kwargs:
        raise refuse(
            f"runtime.kwargs.{sorted(kwargs)[0]}",
            f"not a runtime setting polar-mitm knows ({LOCAL_RUNTIME_KWARG})",
        )
    allow_internet = rt.allow_internet
    if rt.network == "none":
        allow_internet = False
    elif rt.network == "host":
        recorded["runtime.network"] = "host: the sandbox gets a network of its own, never the host's"
    elif rt.network not in (None, "bridge"):
        raise refuse(
            "runtime.network", f"{rt.network[:80]!r}: polar-mitm gives a sandbox its own network, or none"
        )
    if allow_internet:
        recorded["runtime.allow_internet"] = (
            "true: the internet through the proxy, never this host or the engine"
        )
    if rt.storage_mb is not None:
        recorded["runtime.storage_mb"] = "not applied: a sample's disk is bounded by the node's own limits"
    uploads, setup = _prepare(rt.prepare, task_root)
    fields: dict[str, Any] = {
        "image": rt.image.strip(),
        "uploads": uploads,
        "setup": setup,
        "env": dict(rt.env),
        "allow_internet": allow_internet,
        "cpus": rt.cpus,
        "memory_mb": rt.memory_mb,
    }
    if rt.workdir:
        fields["workdir"] = rt.workdir.strip()
    return runtime, fields


def to_request(req: TaskRequest, *, task_root: Path | None = None) -> m.TaskRequest:
    """Polar's TaskRequest as ours (an ApiError naming Polar's field when it cannot be one).
    Its callback is left out: the Polar surface posts it in Polar's shape (`service/polar.py`)."""
    if not m.TASK_ID.fullmatch(req.task_id):
        raise refuse("task_id", "letters, digits and . _ : @ + - (it appears in URLs), at most 200")
    recorded: dict[str, str] = {}
    runtime, task_fields = _runtime(req.runtime, recorded, task_root)
    harness, harness_cmd = _harness(req.agent)
    if req.agent.custom_shell is not None and req.agent.custom_shell.env:
        task_fields["env"].update(req.agent.custom_shell.env)
    task_fields["env"].update(req.agent.env)
    if req.agent.model_name is not None:
        recorded["agent.model_name"] = "every model name is answered by the served policy"
    if req.agent.settings:
        recorded["agent.settings"] = "not applied: sampling and harness settings are serve's policy options"
    if req.builder.strategy not in ("per_request", "prefix_merging"):
        raise refuse(
            "builder.strategy",
            f"{req.builder.strategy[:80]!r}: polar-mitm builds per_request or prefix_merging",
        )
    if req.builder.config:
        raise refuse("builder.config", "polar-mitm's builders take no config")
    agent_timeout = req.metadata.get("agent_timeout")
    total = float(req.timeout_seconds)
    try:
        # Validated as a whole, so a bound of ours names its place (task.cpus -> runtime.cpus).
        ours = m.TaskRequest.model_validate(
            {
                "task_id": req.task_id,
                "task": {
                    "id": req.task_id,
                    "instruction": req.instruction,
                    # Polar's budget is the sample's, from INIT; its agent's is the same unless given.
                    "agent_timeout_sec": float(agent_timeout) if agent_timeout is not None else total,  # type: ignore[arg-type]
                    "total_timeout_sec": total,
                    "evaluator": _evaluator(req.evaluator, recorded, task_root),
                    **task_fields,
                },
                "num_samples": req.num_samples,
                "harness": harness,
                "harness_cmd": harness_cmd,
                "runtime": runtime,
                "builder": Strategy.PER_REQUEST
                if req.builder.strategy == "per_request"
                else Strategy.PREFIX_MERGE,
                "priority": req.dispatch_priority,
                "early_stop_min_usable": req.early_stop_min_usable_sessions,
                "timeout_seconds": total,
                "agent_timeout_seconds": float(agent_timeout) if agent_timeout is not None else None,  # type: ignore[arg-type]
                "metadata": {
                    KEY: {"metadata": req.metadata, "callback_url": req.callback_url, "recorded": recorded}
                },
            }
        )
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        field = next((v for k, v in _OUR_FIELDS.items() if where.startswith(k)), where or "(body)")
        raise refuse(field, err["msg"]) from None
    return ours


# -- replies in Polar's shapes --------------------------------------------------------------------

# Our pipeline's stages (seconds) as SessionTiming's names (milliseconds).
TIMING_NAMES = {
    "queued": "register_to_init_queue_ms",
    "starting": "init_ms",
    "ready": "ready_queue_ms",
    "running": "run_ms",
    "scoring": "postrun_ms",
}
# Our stages as Polar's session statuses, while a sample is under way.
STAGE_STATUS = {
    None: "REGISTERED",
    "queued": "REGISTERED",
    "starting": "INITIALIZING",
    "ready": "READY",
    "running": "RUNNING",
    "scoring": "EVALUATING",
}


def session_status(sample: SampleRow) -> str:
    """A sample's Polar SessionStatus (CANCELLED for one cancelled: no Polar status says so)."""
    if sample.state == "finished":
        return {"completed": "COMPLETED", "agent_timeout": "TIMEOUT", "cancelled": "CANCELLED"}.get(
            sample.status or "", "ERROR"
        )
    return STAGE_STATUS.get(sample.stage, "RUNNING")


def task_state(state: str) -> str:
    """Our task state as Polar's task status vocabulary."""
    return {"done": "completed", "cancelled": "cancelled"}.get(state, "running")


def timing(timings: dict[str, float]) -> dict[str, float]:
    """SessionTiming's fields (ms) from our stages' seconds; e2e is their sum."""
    out = {TIMING_NAMES[k]: round(v * 1000.0, 3) for k, v in timings.items() if k in TIMING_NAMES}
    if timings:
        out["e2e_ms"] = round(sum(timings.values()) * 1000.0, 3)
    return out


def trace(row: dict[str, Any], reward: float | None) -> dict[str, Any]:
    """One of our rows as a Polar Trace (messages are not rendered: the ids are what trains)."""
    meta = (
        json.loads(row.get("metadata") or "{}")
        if isinstance(row.get("metadata"), str)
        else dict(row.get("metadata") or {})
    )
    meta.update(
        {
            "trajectory_id": row["trajectory_id"],
            "session_id": row["session_id"],
            "turn_ids": row["turn_ids"],
            "num_turns": row.get("num_turns"),
            "role": row.get("role") or "main",
            "parent_id": row.get("parent_id"),
            "status": row.get("status"),
        }
    )
    return {
        "prompt_ids": row["prompt_ids"],
        "response_ids": row["response_ids"],
        "loss_mask": row["loss_mask"],
        "prompt_messages": [],
        "response_messages": [],
        "tools": None,
        "finish_reason": row["finish_reason"],
        "response_logprobs": row["response_logprobs"],
        "reward": reward,
        "metadata": meta,
    }


def polar_meta(request_json: str) -> dict[str, Any]:
    """What the mapping kept in our stored request: {metadata, callback_url, recorded}."""
    return m.TaskRequest.model_validate_json(request_json).metadata.get(KEY) or {}


def session_result(
    task_id: str, sample: SampleRow, rows: list[dict[str, Any]], kept: dict[str, Any]
) -> dict[str, Any]:
    """A finished sample as Polar's SessionResult: the reward on its last trace."""
    status = session_status(sample)
    detail = json.loads(sample.detail or "null")
    error = None if status == "COMPLETED" else (sample.cause or sample.status)
    traces = [trace(r, sample.reward if i == len(rows) - 1 else None) for i, r in enumerate(rows)]
    ours = {
        "sample_index": sample.idx,
        "status": sample.status,
        "dispatches": sample.dispatches,
        "weight_versions": json.loads(sample.weight_versions or "[]"),
        "trainable": sample.status in TRAINABLE,
        "recorded": kept.get("recorded", {}),
    }
    return {
        "session_id": sample.session_id or f"{task_id}:{sample.idx}",
        "task_id": task_id,
        "status": status,
        "trajectory": {
            "status": status,
            "metadata": {"reward": sample.reward, "reward_detail": detail, "record_count": len(rows)},
            "traces": traces,
            "error": error,
        },
        "timing": timing(json.loads(sample.timings or "{}")),
        "node_id": sample.node_id,
        "error": error,
        "metadata": {**kept.get("metadata", {}), "polar_mitm": ours},
    }


def task_status(
    summary: TaskSummary,
    samples: list[SampleRow],
    rows: dict[int, list[dict[str, Any]]],
    kept: dict[str, Any],
) -> dict[str, Any]:
    """A task as Polar's TaskStatus: the finished samples' results (a cancelled one has none),
    also under `sessions`."""
    results = [
        session_result(summary.id, s, rows.get(s.idx, []), kept)
        for s in samples
        if s.state == "finished" and s.status != "cancelled"
    ]
    return {
        "task_id": summary.id,
        "status": task_state(summary.state),
        "total_sessions": summary.num_samples,
        "completed_sessions": len(results),
        "results": results,
        "result_paths": [],
        "sessions": results,
    }


def node_info(view: m.NodeView, gateway_url: str, heartbeat_interval: int) -> dict[str, Any]:
    """One of our nodes as Polar's GatewayNodeInfo: its gateway URL one the Polar surface answers."""
    stages = view.load.stages if view.load else {}

    def load(name: str, what: str) -> int:
        s = stages.get(name)
        return int(getattr(s, what)) if s else 0

    return {
        "node_id": view.node_id,
        "gateway_url": gateway_url,
        "max_init_workers": max(1, view.workers.get("init", 1)),
        "max_run_workers": max(1, view.workers.get("run", 1)),
        "max_postrun_workers": max(1, view.workers.get("postrun", 1)),
        "metrics": {
            "init_queue_depth": load("init", "queued"),
            "init_inflight": load("init", "in_flight"),
            "ready_depth": load("ready", "queued") + load("ready", "in_flight"),
            "run_inflight": load("run", "in_flight"),
            "postrun_queue_depth": load("postrun", "queued"),
            "postrun_inflight": load("postrun", "in_flight"),
        },
        "dispatch_reservations": view.dispatched,
        "healthy": view.healthy,
        "draining": view.state == "draining",
        "heartbeat_interval_seconds": heartbeat_interval,
        "last_heartbeat": datetime.fromtimestamp(view.last_seen, UTC).isoformat(),
    }

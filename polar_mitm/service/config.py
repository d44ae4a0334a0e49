"""What a rollout server is given (`ServerConfig`): one frozen model that `RolloutServer` takes, that
a Python user builds, and that `serve` generates its options from (`cli/options.py`'s
`model_options`, as the policy's and the rollout's are). Light: pydantic only, so `serve --help`
loads no server.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ServerConfig(BaseModel):
    """The rollout server's state, who may drive it, what reaches the host, its limits and its
    patience with nodes. What reaches the host (the `local` runtime, task paths, callbacks) is off
    unless turned on here."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    db: Path = Field(description="the server's SQLite store: a restarted server loses no task")
    # The operator's control token; None: a random one (the server is never open). `serve` gives
    # it the token of its token file.
    token: str | None = Field(None, repr=False)
    allow_local_runtime: bool = Field(
        False, description="accept tasks with runtime 'local' (run unsandboxed on the nodes' hosts)"
    )
    task_root: Path | None = Field(
        None, description="read task paths a client names under this directory only; none without it"
    )
    callback_allow: tuple[str, ...] = Field(
        (), description="hosts a task's callback_url may name (lower case); none without them"
    )
    polar_api: bool = Field(False, description="serve Polar's rollout API too, under a secret prefix")
    max_body_mb: float = Field(4.0, ge=0.01, description="the largest request body")
    max_result_mb: float = Field(256.0, ge=0.01, description="the largest sample report of a node")
    node_timeout: float = Field(15.0, description="seconds without a heartbeat before a node is lost")
    deadline_grace: float = Field(
        60.0, description="seconds past a sample's timeout before its node is no longer waited for"
    )
    max_dispatches: int = Field(2, ge=1, description="times a sample is dispatched before it fails")
    callback_attempts: int = Field(8, ge=1, description="tries of a group's callback before it is given up")
    callback_backoff: float = Field(
        1.0, ge=0, description="seconds before a callback's second try (doubling)"
    )

    @field_validator("callback_allow", mode="before")
    @classmethod
    def _hosts(cls, value: object) -> object:
        """Hosts given several times, comma-separated, or both: each once, in lower case."""
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (list, tuple, set, frozenset)):
            hosts = [h.strip().lower() for item in value for h in str(item).split(",")]
            return tuple(dict.fromkeys(h for h in hosts if h))
        return value

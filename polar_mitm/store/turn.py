"""The row model of `turns`: what a writer stores is what a reader builds back."""

from __future__ import annotations

import time

from pydantic import BaseModel, Field


class Turn(BaseModel):
    """One row of `turns`: a generation (or a harvested exchange) as the proxy saw it.

    Writers (the policy, harvest) build it and `Store.insert_turn` stores it; readers
    (`read_turns`, `queries`) build it back, its prompt resolved through its reference. The one
    row model of the table: what is written is what is read. A reader fills the columns it reads
    (`read_turns`: the token ids and what reconstruction needs, the raw request with `with_raw`);
    the others keep their defaults.
    """

    id: str
    session_id: str
    seq: int = 0  # its place among all turns: given by SQLite on insert, filled by readers
    created_at: float = Field(default_factory=time.time)
    style: str
    host: str | None = None
    path: str | None = None
    model: str | None = None
    tag: str | None = None
    status: str = "ok"
    finish_reason: str | None = None
    prompt_ids: list[int] = Field(default_factory=list)
    prompt_ref: str | None = None
    prompt_ref_len: int = 0
    output_ids: list[int] = Field(default_factory=list)
    output_logprobs: list[float] = Field(default_factory=list)
    weight_version: str | None = None
    # What the engine's logprobs are of (`polar_mitm.backends.logprobs.MODES`: sampling, tempered,
    # raw, logits); None: unknown, or not sampled here (harvested).
    logprobs_mode: str | None = None
    # What the proxy's tool parser made of the output, as JSON (`OutputParser.parse_status`: the
    # parser, the calls read, the blocks that failed with their kind and token span); None: no
    # tool parser read it.
    tool_parse: str | None = None
    msg_hash: str | None = None
    post_hash: str | None = None
    request: str | None = None
    request_headers: dict[str, str] = Field(default_factory=dict)
    response: str | None = None
    error: str | None = None
    latency_ms: float | None = None
    # Filled by readers from the turn's session (never written with the turn): its task, its
    # reward, and whether the turn has no token ids at all (a harvested exchange).
    task_id: str | None = None
    reward: float | None = None
    text_only: bool = False

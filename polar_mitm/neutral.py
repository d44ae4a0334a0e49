"""The neutral model every provider style maps to and from.

A provider module parses its native request into a `ChatRequest` and renders a `Completion`
(or a stream of `Event`s) back into its native JSON or SSE. Nothing here knows about any
provider; nothing in a provider knows about SGLang.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class ToolCall(BaseModel):
    id: str
    name: str
    # Parsed JSON arguments. A model that emits invalid JSON keeps its raw text in `raw`.
    arguments: dict[str, Any] = Field(default_factory=dict)
    raw: str | None = None

    def arguments_json(self) -> str:
        return self.raw if self.raw is not None else json.dumps(self.arguments, ensure_ascii=False)


class Message(BaseModel):
    role: Role
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None  # tool name, for role == "tool"

    def to_template(self) -> dict[str, Any]:
        """The message as Hugging Face chat templates expect it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments if c.raw is None else c.raw},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


class Tool(BaseModel):
    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    def to_template(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


class Sampling(BaseModel):
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = Field(default_factory=list)
    # JSON schema for constrained decoding (Gemini's responseJsonSchema, OpenAI's json_schema).
    json_schema: dict[str, Any] | None = None


class ChatRequest(BaseModel):
    """One generation request, whatever API style it arrived in."""

    style: str
    model: str = ""
    messages: list[Message]
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None
    sampling: Sampling = Field(default_factory=Sampling)
    stream: bool = False
    thinking: bool | None = None  # None: the template's default


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0  # all sampled tokens, reasoning included
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, those of the reasoning block


class Completion(BaseModel):
    """What the policy produced for one request, already parsed."""

    turn_id: str
    model: str
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: FinishReason = "stop"
    stop_sequence: str | None = None
    usage: Usage = Field(default_factory=Usage)

    def as_message(self) -> Message:
        return Message(
            role="assistant", content=self.text, reasoning=self.reasoning or None, tool_calls=self.tool_calls
        )


# ---- streaming events, produced by the policy and rendered by each provider ----------------


class Started(BaseModel):
    """The first event: the prompt is rendered and the backend accepted it."""

    kind: Literal["started"] = "started"
    turn_id: str
    prompt_tokens: int


class Ping(BaseModel):
    kind: Literal["ping"] = "ping"


class ReasoningDelta(BaseModel):
    kind: Literal["reasoning"] = "reasoning"
    text: str


class TextDelta(BaseModel):
    kind: Literal["text"] = "text"
    text: str


class ToolCallEvent(BaseModel):
    kind: Literal["tool_call"] = "tool_call"
    call: ToolCall


class Done(BaseModel):
    """The last event: the turn is already committed to the store when this is yielded."""

    kind: Literal["done"] = "done"
    completion: Completion


Event = Started | Ping | ReasoningDelta | TextDelta | ToolCallEvent | Done


class ProviderError(Exception):
    """An error the harness should see, in its provider's own error shape.

    `kind` is neutral: invalid_request, request_too_large, authentication, permission, not_found,
    rate_limit, overloaded, api_error, timeout.
    """

    def __init__(self, kind: str, message: str, status: int = 400):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.status = status


def new_turn_id() -> str:
    """A new turn's id: time-ordered, so ids sort like the turns they name."""
    return f"turn_{time.time_ns():x}{uuid.uuid4().hex[:8]}"

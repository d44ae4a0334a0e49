"""A new user's client code, one function per SDK: run by tests/e2e/test_sdks.py under the SDK
virtualenv (scripts/install.sh), as `polar-mitm run -- python sdk_clients.py SDK`.

Every client talks to its provider's DEFAULT URL (no base-URL override; the proxy intercepts
it). Each makes the same calls: a plain answer, streamed and not, and a tool round trip (the
model calls `get_weather`, we send its result back), streamed and not; then one call to an
endpoint the proxy does not serve (embeddings), which must raise the SDK's own not-found error.
It prints one JSON line: what each call returned, for the test to compare with the store.

Imports nothing of polar-mitm: it is what a user would write.
"""

from __future__ import annotations

import json
import sys
from typing import Any

SYSTEM = "You are the weather desk of polar-mitm's SDK test."
ASK = "What is the weather in Paris?"
HELLO = "Say hello."
TOOL = "get_weather"
TOOL_DESCRIPTION = "Current weather of a city"
TOOL_RESULT = "sunny, 21 C"
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "City name"}},
    "required": ["city"],
}


def _out(calls: list[dict[str, Any]], not_found: str) -> None:
    print(json.dumps({"calls": calls, "not_found": not_found}))


def run_anthropic() -> None:
    import anthropic

    client = anthropic.Anthropic()
    model = "claude-sonnet-4-5"
    tools = [{"name": TOOL, "description": TOOL_DESCRIPTION, "input_schema": PARAMETERS}]
    calls: list[dict[str, Any]] = []

    def text_of(msg) -> str:
        return "".join(b.text for b in msg.content if b.type == "text")

    msg = client.messages.create(
        model=model, max_tokens=256, system=SYSTEM, messages=[{"role": "user", "content": HELLO}]
    )
    calls.append({"kind": "text", "stream": False, "text": text_of(msg)})
    with client.messages.stream(
        model=model, max_tokens=256, system=SYSTEM, messages=[{"role": "user", "content": HELLO}]
    ) as s:
        msg = s.get_final_message()
    calls.append({"kind": "text", "stream": True, "text": text_of(msg)})
    for stream in (False, True):
        messages: list[dict[str, Any]] = [{"role": "user", "content": ASK}]
        kw = dict(model=model, max_tokens=256, system=SYSTEM, tools=tools)
        if stream:
            with client.messages.stream(messages=messages, **kw) as s:
                first = s.get_final_message()
        else:
            first = client.messages.create(messages=messages, **kw)
        [use] = [b for b in first.content if b.type == "tool_use"]
        calls.append({"kind": "tool_call", "stream": stream, "name": use.name, "arguments": use.input})
        messages += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_RESULT}],
            },
        ]
        if stream:
            with client.messages.stream(messages=messages, **kw) as s:
                final = s.get_final_message()
        else:
            final = client.messages.create(messages=messages, **kw)
        calls.append({"kind": "tool_result", "stream": stream, "text": text_of(final)})
    # Anthropic has no embeddings endpoint: its batch API is the one we do not serve.
    try:
        client.messages.batches.create(
            requests=[{"custom_id": "a", "params": {"model": model, "max_tokens": 8, "messages": []}}]
        )
        not_found = "no error"
    except anthropic.NotFoundError as e:
        not_found = f"NotFoundError: {e}"
    _out(calls, not_found)


def _openai_chat(create, stream: bool, **kw) -> dict[str, Any]:
    """One Chat Completions call, streamed or not, folded into {"content", "tool_calls"}."""
    if not stream:
        m = create(stream=False, **kw).choices[0].message
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in m.tool_calls or []
        ]
        return {"content": m.content or "", "tool_calls": calls}
    content, parts = "", {}
    for chunk in create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            p = parts.setdefault(c.index, {"id": "", "name": "", "arguments": ""})
            p["id"] += c.id or ""
            if c.function:
                p["name"] += c.function.name or ""
                p["arguments"] += c.function.arguments or ""
    return {"content": content, "tool_calls": [parts[i] for i in sorted(parts)]}


def _chat_round_trips(create, model: str) -> list[dict[str, Any]]:
    """The plain and tool cases through any Chat-Completions-shaped `create` (openai, litellm)."""
    tools = [
        {
            "type": "function",
            "function": {"name": TOOL, "description": TOOL_DESCRIPTION, "parameters": PARAMETERS},
        }
    ]
    system = {"role": "system", "content": SYSTEM}
    calls: list[dict[str, Any]] = []
    for stream in (False, True):
        r = _openai_chat(create, stream, model=model, messages=[system, {"role": "user", "content": HELLO}])
        calls.append({"kind": "text", "stream": stream, "text": r["content"]})
    for stream in (False, True):
        messages: list[dict[str, Any]] = [system, {"role": "user", "content": ASK}]
        first = _openai_chat(create, stream, model=model, messages=messages, tools=tools)
        [call] = first["tool_calls"]
        calls.append(
            {
                "kind": "tool_call",
                "stream": stream,
                "name": call["name"],
                "arguments": json.loads(call["arguments"]),
            }
        )
        messages += [
            {
                "role": "assistant",
                "content": first["content"] or None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": call["arguments"]},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": TOOL_RESULT},
        ]
        final = _openai_chat(create, stream, model=model, messages=messages, tools=tools)
        calls.append({"kind": "tool_result", "stream": stream, "text": final["content"]})
    return calls


def run_openai() -> None:
    import openai

    client = openai.OpenAI()
    calls = _chat_round_trips(client.chat.completions.create, "gpt-4o")
    try:
        client.embeddings.create(model="text-embedding-3-small", input="x")
        not_found = "no error"
    except openai.NotFoundError as e:
        not_found = f"NotFoundError: {e}"
    _out(calls, not_found)


def run_google_genai() -> None:
    from google import genai
    from google.genai import errors, types

    client = genai.Client()
    model = "gemini-2.5-flash"
    tool = types.Tool(
        function_declarations=[
            types.FunctionDeclaration(
                name=TOOL, description=TOOL_DESCRIPTION, parameters_json_schema=PARAMETERS
            )
        ]
    )
    plain = types.GenerateContentConfig(system_instruction=SYSTEM)
    with_tools = types.GenerateContentConfig(
        system_instruction=SYSTEM,
        tools=[tool],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )

    def call(stream: bool, contents, config) -> list[types.Part]:
        if not stream:
            return list(
                client.models.generate_content(model=model, contents=contents, config=config).parts or []
            )
        parts: list[types.Part] = []
        for chunk in client.models.generate_content_stream(model=model, contents=contents, config=config):
            parts += chunk.parts or []
        return parts

    def text_of(parts) -> str:
        return "".join(p.text or "" for p in parts if not p.thought)

    calls: list[dict[str, Any]] = []
    for stream in (False, True):
        calls.append({"kind": "text", "stream": stream, "text": text_of(call(stream, HELLO, plain))})
    for stream in (False, True):
        contents = [types.Content(role="user", parts=[types.Part(text=ASK)])]
        first = call(stream, contents, with_tools)
        [fc] = [p.function_call for p in first if p.function_call]
        calls.append(
            {"kind": "tool_call", "stream": stream, "name": fc.name, "arguments": dict(fc.args or {})}
        )
        contents += [
            types.Content(role="model", parts=first),
            types.Content(
                role="user",
                parts=[types.Part.from_function_response(name=fc.name, response={"result": TOOL_RESULT})],
            ),
        ]
        calls.append(
            {"kind": "tool_result", "stream": stream, "text": text_of(call(stream, contents, with_tools))}
        )
    try:
        client.models.embed_content(model="gemini-embedding-001", contents="x")
        not_found = "no error"
    except errors.ClientError as e:
        not_found = f"NotFoundError: {e}" if e.code == 404 else f"{e.code}: {e}"
    _out(calls, not_found)


def run_litellm(provider: str) -> None:
    import litellm

    model = {
        "anthropic": "anthropic/claude-sonnet-4-5",
        "openai": "openai/gpt-4o",
        "gemini": "gemini/gemini-2.5-flash",
    }[provider]
    calls = _chat_round_trips(lambda **kw: litellm.completion(max_tokens=256, **kw), model)
    # litellm offers no Anthropic call that reaches an endpoint we do not serve (it has no
    # Anthropic embeddings, and its batch API refuses the anthropic provider).
    embedding = {"openai": "openai/text-embedding-3-small", "gemini": "gemini/gemini-embedding-001"}
    not_found = "not tried"
    if provider in embedding:
        try:
            litellm.embedding(model=embedding[provider], input=["x"])
            not_found = "no error"
        except litellm.NotFoundError as e:
            not_found = f"NotFoundError: {e}"
        except Exception as e:  # noqa: BLE001 - reported, and the test says which
            not_found = f"{type(e).__name__}: {e}"
    _out(calls, not_found)


if __name__ == "__main__":
    sdk = sys.argv[1]
    if sdk.startswith("litellm-"):
        run_litellm(sdk.removeprefix("litellm-"))
    else:
        {"anthropic": run_anthropic, "openai": run_openai, "google-genai": run_google_genai}[sdk]()

"""The official Python SDKs, at their default URLs, through `polar-mitm run` (no base-URL setting,
no recipe: the generic one), against the fake backend.

anthropic, openai and google-genai, and litellm for each of its three providers (its `gemini/`
provider sends the snake_case spelling of Gemini bodies). tests/e2e/sdk_clients.py makes the
calls a user would make: a plain answer and a tool round trip, each streamed and not, and one
call to an endpoint polar-mitm does not serve. Every model call must come back as the fake
answered it, be stored token-exact, and its stored prompt (decoded with the tokenizer) must
hold the system prompt, the tool, and the tool's result that the client sent; the unserved
endpoint must raise the SDK's own not-found error.

The SDKs live in their own virtualenv (scripts/install.sh), not the project's: litellm alone
brings some fifty packages.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from polar_mitm.cache import cache_dir
from polar_mitm.store.reader import read_turns
from tests.e2e import sdk_clients as c
from tests.support.harness import FakeBackend, assert_turns_match_backend, harness_env, polar_run

pytestmark = pytest.mark.e2e

SDK_PYTHON = cache_dir() / "venvs" / "sdks" / "bin" / "python"
CLIENTS = Path(__file__).with_name("sdk_clients.py")

HELLO_REPLY = "Hello from the SDK test."
WEATHER_REPLY = "It is sunny in Paris."
SCRIPT = [
    {"match": "<tool_response>", "text": WEATHER_REPLY},
    {"match": r"weather in (\w+)", "tool_call": {"name": c.TOOL, "arguments": {"city": "\\1"}}},
    {"match": "", "text": HELLO_REPLY},
]

# sdk -> (API style of the stored turns, the host it called)
CASES = {
    "anthropic": ("anthropic", "api.anthropic.com"),
    "openai": ("openai-chat", "api.openai.com"),
    "google-genai": ("gemini", "generativelanguage.googleapis.com"),
    "litellm-anthropic": ("anthropic", "api.anthropic.com"),
    "litellm-openai": ("openai-chat", "api.openai.com"),
    "litellm-gemini": ("gemini", "generativelanguage.googleapis.com"),
}


@pytest.fixture(scope="module")
def script_backend(qwen_tokenizer_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("sdk") / "script.json"
    path.write_text(json.dumps(SCRIPT))
    b = FakeBackend(qwen_tokenizer_dir, "--script", str(path))
    yield b
    b.stop()


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(qwen_tokenizer_dir / "tokenizer.json"))


@pytest.mark.parametrize("sdk", sorted(CASES))
def test_sdk_at_its_default_url_round_trips_every_call(
    sdk, tmp_path, script_backend, qwen_tokenizer_dir, tokenizer
):
    if not SDK_PYTHON.exists():
        pytest.fail(f"{SDK_PYTHON} is missing: scripts/install.sh makes the SDK virtualenv")
    style, host = CASES[sdk]
    db = tmp_path / "runs.sqlite"
    env = harness_env(tmp_path / "home")
    # litellm fetches its model price list from GitHub at import unless told to use its own copy.
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    session = f"sdk-{sdk}"
    r = polar_run(
        ["--backend", script_backend.url, "--tokenizer", str(qwen_tokenizer_dir), "--db", str(db)]
        + ["--session", session],
        [str(SDK_PYTHON), str(CLIENTS), sdk],
        cwd=tmp_path,
        env=env,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])

    # What the client got back is what the fake answered.
    calls = out["calls"]
    assert [(x["kind"], x["stream"]) for x in calls] == [
        ("text", False),
        ("text", True),
        ("tool_call", False),
        ("tool_result", False),
        ("tool_call", True),
        ("tool_result", True),
    ]
    for x in calls:
        if x["kind"] == "text":
            assert x["text"].strip() == HELLO_REPLY, x
        elif x["kind"] == "tool_call":
            assert (x["name"], x["arguments"]) == (c.TOOL, {"city": "Paris"}), x
        else:
            assert x["text"].strip() == WEATHER_REPLY, x
    if sdk == "litellm-anthropic":
        assert out["not_found"] == "not tried"
    else:
        assert out["not_found"].startswith("NotFoundError"), out["not_found"]
        assert "not served by polar-mitm" in out["not_found"], out["not_found"]

    # Every model call is one stored main turn, in the client's style, at the default host.
    turns = [t for t in read_turns(db, session=session) if t.tag is None]
    assert len(turns) == len(calls), [t.path for t in turns]
    assert {t.style for t in turns} == {style}
    con = sqlite3.connect(db)
    assert {
        h for (h,) in con.execute("SELECT DISTINCT host FROM turns WHERE session_id = ?", (session,))
    } == {host}
    expected_finish = ["stop", "stop", "tool_calls", "stop", "tool_calls", "stop"]
    assert [t.finish_reason for t in turns] == expected_finish
    # The stored prompt is what the client sent: its system prompt, its tool, and the tool's result.
    for t, x in zip(turns, calls, strict=True):
        prompt = tokenizer.decode(t.prompt_ids, skip_special_tokens=False)
        assert c.SYSTEM in prompt, (x, prompt)
        if x["kind"] == "text":
            assert c.HELLO in prompt and c.TOOL not in prompt
        else:
            assert c.ASK in prompt and f'"name": "{c.TOOL}"' in prompt and c.TOOL_DESCRIPTION in prompt, (
                prompt
            )
            assert '"city"' in prompt
        if x["kind"] == "tool_result":
            assert c.TOOL_RESULT in prompt.split("<tool_response>", 1)[-1], prompt
    if sdk == "litellm-gemini":  # the spelling that was once misread: prove this run used it
        raw = [json.loads(t.request) for t in read_turns(db, session=session, with_raw=True) if t.tag is None]
        assert all("system_instruction" in body for body in raw), [sorted(b) for b in raw]
    assert_turns_match_backend(script_backend, db)

"""Chat backend mode: the server renders via /v1/chat/completions; ids and logprobs still come
from the engine and are stored exactly."""

import httpx
import pytest

from polar_mitm.backends.chat_mode import parse_chat_result
from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.fake import Rule
from polar_mitm.neutral import ProviderError
from polar_mitm.store.reader import read_turns
from tests.support.helpers import BASH, sse_events
from tests.support.helpers import MESSAGES_URL as URL


async def test_chat_mode_turns_are_token_exact_and_linked(make_stack):
    stack = await make_stack(policy={"backend_mode": "chat"})
    first = [{"role": "user", "content": "Create out.txt containing hi"}]
    base = {"model": "claude-x", "max_tokens": 300, "system": "sys", "tools": [BASH]}
    async with stack.client() as c:
        r1 = (await c.post(URL, json={**base, "messages": first})).json()
        [use] = [b for b in r1["content"] if b["type"] == "tool_use"]
        assert use["id"].startswith("toolu_") and "out.txt" in use["input"]["command"]
        second = first + [
            {"role": "assistant", "content": r1["content"]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "done"}],
            },
        ]
        r2 = await c.post(URL, json={**base, "messages": second, "stream": True})
    events = sse_events(r2.text)
    assert [e for e, _ in events][-1] == "message_stop"
    text = "".join(d["delta"].get("text", "") for e, d in events if e == "content_block_delta")
    assert text == "Done. The command finished."
    t1, t2 = list(read_turns(stack.db))
    async with httpx.AsyncClient(timeout=30) as c:
        reqs = (await c.get(stack.backend_url + "/_fake/requests")).json()["requests"]
        assert all(r["path"] == "/v1/chat/completions" for r in reqs)
        # The engine's own answer for turn 1's prompt ids, straight from /generate.
        again = (
            await c.post(
                stack.backend_url + "/generate",
                json={
                    "input_ids": t1.prompt_ids,
                    "sampling_params": {"max_new_tokens": 300},
                    "return_logprob": True,
                },
            )
        ).json()
    assert t1.output_ids == again["output_ids"]
    assert t1.output_logprobs == [x[0] for x in again["meta_info"]["output_token_logprobs"]]
    # The server rendered the echoed reply canonically; here it equals prompt + sampled ids.
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert t2.prompt_ref == t1.id


async def test_chat_mode_counts_reasoning_tokens_as_render_mode_does(make_stack, qwen_tokenizer_dir):
    """The reasoning block's tokens (through `</think>`) in the harness's usage, chat mode too."""
    rules = [Rule(match="think", reasoning="pondering the files", text="answer")]
    stack = await make_stack(policy={"backend_mode": "chat"}, backend={"script": rules})
    async with stack.client() as c:
        r = await c.post(
            "https://api.openai.com/v1/responses", json={"model": "gpt-x", "input": "think, then answer"}
        )
    usage = r.json()["usage"]
    [turn] = list(read_turns(stack.db))
    end = Tokenizer.load(qwen_tokenizer_dir).token_id("</think>")
    assert usage["output_tokens_details"]["reasoning_tokens"] == turn.output_ids.index(end) + 1
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < usage["output_tokens"]


def test_missing_token_ids_are_refused_clearly():
    with pytest.raises(ProviderError, match="did not return token ids"):
        parse_chat_result({"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]})


def test_vllm_shape_is_read():
    r = parse_chat_result(
        {
            "prompt_token_ids": [1, 2],
            "choices": [
                {
                    "message": {"content": "hi"},
                    "finish_reason": "stop",
                    "token_ids": [5, 6],
                    "logprobs": {
                        "content": [{"token": "h", "logprob": -0.5}, {"token": "i", "logprob": -0.25}]
                    },
                }
            ],
        }
    )
    assert (r.prompt_ids, r.output_ids, r.output_logprobs, r.text) == ([1, 2], [5, 6], [-0.5, -0.25], "hi")

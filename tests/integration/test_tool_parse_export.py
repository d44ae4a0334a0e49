"""A tool call the policy wrote badly, from the proxy to the export: the stored turn records what
its tool parser made of it, the export's `tool_parse` column and metadata name it, the three
policies (`--tool-parse-failures keep|mask|zero`) give a trainer what they say, and `stats`
shows the rate."""

import json

import pyarrow.parquet as pq
import pytest

from polar_mitm.reconstruct.export import compute_stats, export
from polar_mitm.store.queries import set_reward
from polar_mitm.store.reader import read_turns
from tests.support.helpers import BASH, MESSAGES_URL

BROKEN = '<tool_call>{"name": "Bash", "arguments": {"command": "ls"</tool_call>'
SCRIPT = [
    {"match": "again", "text": BROKEN},  # the second turn: JSON cut short, sent as text
    {"match": "", "tool_call": {"name": "Bash", "arguments": {"command": "ls"}}},
]


@pytest.fixture
async def store_with_a_broken_call(make_stack):
    stack = await make_stack(backend={"script": SCRIPT}, policy={"backend_stream": "stream"})
    msgs = [{"role": "user", "content": "go"}]
    async with stack.client() as c:
        reply = (
            await c.post(
                MESSAGES_URL, json={"model": "m", "max_tokens": 256, "messages": msgs, "tools": [BASH]}
            )
        ).json()
        use = next(b for b in reply["content"] if b["type"] == "tool_use")
        msgs += [
            {"role": "assistant", "content": reply["content"]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "again"}],
            },
        ]
        reply = (
            await c.post(
                MESSAGES_URL, json={"model": "m", "max_tokens": 256, "messages": msgs, "tools": [BASH]}
            )
        ).json()
        assert [b["type"] for b in reply["content"]] == ["text"]  # the harness got text, as before
    set_reward(stack.db, "s-test", 1.0)
    return stack.db


async def test_the_turn_records_the_failure_with_its_token_span(store_with_a_broken_call):
    good, bad = list(read_turns(store_with_a_broken_call))
    assert json.loads(good.tool_parse) == {"parser": "qwen25", "calls": 1, "failures": []}
    status = json.loads(bad.tool_parse)
    [failure] = status["failures"]
    assert failure["kind"] == "invalid_json" and status["calls"] == 0
    start, end = failure["span"]
    assert 0 <= start < end <= len(bad.output_ids)


@pytest.mark.parametrize("strategy", ["prefix-merge", "per-request"])
async def test_keep_mask_and_zero(store_with_a_broken_call, tmp_path, strategy):
    db = store_with_a_broken_call
    rows = {}
    for policy in ("keep", "mask", "zero"):
        export(db, tmp_path / f"{policy}.parquet", strategy=strategy, quiet=True, tool_parse_failures=policy)
        rows[policy] = pq.read_table(tmp_path / f"{policy}.parquet").to_pylist()
    last = {p: r[-1] for p, r in rows.items()}  # the row that trains the broken turn
    assert last["keep"]["tool_parse"] == "invalid_json" and last["keep"]["reward"] == 1.0
    meta = json.loads(last["keep"]["metadata"])
    [failure] = meta["tool_parse_failures"]
    start, end = failure["row_span"]  # in prompt_ids + response_ids: here in the response
    start, end = start - len(last["keep"]["prompt_ids"]), end - len(last["keep"]["prompt_ids"])
    assert 0 <= start < end and end - start == failure["span"][1] - failure["span"][0]
    assert last["keep"]["loss_mask"][start:end] == [1] * (end - start)
    # mask: the broken turn untrained (in prefix-merge the turn before it still is)
    assert sum(last["mask"]["loss_mask"][start:end]) == 0
    untrained = len(last["mask"]["loss_mask"]) - sum(last["mask"]["loss_mask"])
    assert untrained >= end - start and last["mask"]["response_ids"] == last["keep"]["response_ids"]
    if strategy == "prefix-merge":
        assert sum(last["mask"]["loss_mask"]) > 0
    assert last["zero"]["reward"] == 0.0 and last["zero"]["loss_mask"] == last["keep"]["loss_mask"]
    if strategy == "per-request":
        first = rows["keep"][0]
        assert first["tool_parse"] == "ok" and sum(last["mask"]["loss_mask"]) == 0
        assert sum(rows["mask"][0]["loss_mask"]) == len(first["response_ids"])  # a good turn is trained


async def test_stats_show_the_rate_per_harness_and_parser(store_with_a_broken_call):
    stats = compute_stats(store_with_a_broken_call, quiet=True)
    [rate] = stats.tool_parse
    assert (rate.parser, rate.turns, rate.failed_turns, rate.failures) == (
        "qwen25",
        2,
        1,
        {"invalid_json": 1},
    )
    assert "tool parse           - / qwen25: 1 of 2 turns failed (50.0%): invalid_json 1" in stats.render()


async def test_a_masked_first_turn_keeps_its_span_in_the_whole_sequence(tmp_path):
    """With `mask`, a row whose first trained turn failed starts training later: its prompt_ids
    grow, and the failure's `row_span` still points at that turn's tokens."""
    from polar_mitm.store.turn import Turn
    from polar_mitm.store.writer import Store

    failed = json.dumps({"parser": "qwen25", "calls": 0, "failures": [{"kind": "unclosed", "span": [1, 3]}]})
    db = tmp_path / "s.sqlite"
    store = await Store.open(db)
    await store.ensure_session("s")
    for t in (
        Turn(id="t1", session_id="s", style="anthropic", created_at=1.0, prompt_ids=[1, 2], output_ids=[7, 8, 9],
             output_logprobs=[-0.1] * 3, finish_reason="length", tool_parse=failed),
        Turn(id="t2", session_id="s", style="anthropic", created_at=2.0, prompt_ids=[1, 2, 7, 8, 9, 3],
             output_ids=[10, 11], output_logprobs=[-0.2] * 2, finish_reason="stop",
             tool_parse='{"parser":"qwen25","calls":0,"failures":[]}'),
    ):  # fmt: skip
        await store.insert_turn(t)
    await store.close()
    export(db, tmp_path / "m.parquet", quiet=True, tool_parse_failures="mask")
    [row] = pq.read_table(tmp_path / "m.parquet").to_pylist()
    seq = row["prompt_ids"] + row["response_ids"]
    [failure] = json.loads(row["metadata"])["tool_parse_failures"]
    start, end = failure["row_span"]
    assert seq[start:end] == [8, 9] and row["prompt_ids"] == [1, 2, 7, 8, 9, 3]
    assert row["response_ids"] == [10, 11] and row["loss_mask"] == [1, 1] and row["tool_parse"] == "unclosed"

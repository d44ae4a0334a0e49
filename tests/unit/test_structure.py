"""Multi-agent structure on export: a session's conversations as main, subagent, compaction and
side rows, each linked to the row it came from (reconstruct/structure.py)."""

import json

import numpy as np
import pyarrow.parquet as pq

from polar_mitm.reconstruct import structure
from polar_mitm.reconstruct.export import export, iter_trajectories
from polar_mitm.store.turn import Turn
from polar_mitm.store.writer import Store


def completion(*calls):
    return json.dumps({"text": "", "tool_calls": [{"id": i, "name": n, "arguments": {}} for i, n in calls]})


def turn(id, prompt, output, at, response=None, tag=None, request=None):
    return Turn(
        id=id,
        session_id="s",
        style="anthropic",
        created_at=at,
        tag=tag,
        finish_reason="tool_calls" if response else "stop",
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=[-0.5] * len(output),
        response=response or '{"text": "done"}',
        request=request,
        path="/v1/messages",
    )


def carrying(*results):
    """An Anthropic request whose last message carries the results of these tool calls."""
    return json.dumps(
        {
            "model": "m",
            "max_tokens": 100,
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": i, "name": "T", "input": {}} for i in results],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": i, "content": "ok"} for i in results],
                },
            ],
        }
    )


SYSTEM = list(range(1000, 1020))
SUMMARY = list(range(5000, 5040))  # 40 sampled tokens: the compaction summary


async def write(db, turns, reward=1.0):
    store = await Store.open(db)
    await store.ensure_session("s", task_id="t")
    for t in turns:
        await store.insert_turn(t)
    await store.close()
    import sqlite3

    with sqlite3.connect(db) as con:
        con.execute("UPDATE sessions SET reward = ?", (reward,))


def claude_code_like_session():
    """main: asks the Agent tool (m1); a subagent runs two turns meanwhile (a1, a2); main goes on
    with the tool result (m2), then summarizes itself (m3); the compacted conversation carries
    the summary (c1); a title side call in between (x1)."""
    m1_out = [7, 8, 9]
    m2_prompt = SYSTEM + [1, 2] + m1_out + [3, 3]  # + the Agent tool's result
    return [
        turn("m1", SYSTEM + [1, 2], m1_out, 10.0, completion(("toolu_agent", "Agent"))),
        turn("x1", [2000, 2001], [2002], 10.5, tag="title"),
        turn("a1", [3000, 3001, 3002], [31, 32], 11.0, completion(("toolu_bash", "Bash"))),
        turn("a2", [3000, 3001, 3002, 31, 32, 40], [41], 12.0),
        turn("m2", m2_prompt, [50, 51], 13.0),
        turn("m3", m2_prompt + [50, 51, 60], SUMMARY, 14.0),
        turn("c1", [4000, 4001] + SUMMARY[:-1] + [4002], [70], 15.0),
    ]


async def test_subagent_compaction_and_side_rows_are_linked_to_their_parents(tmp_path):
    db = tmp_path / "s.sqlite"
    await write(db, claude_code_like_session())
    from polar_mitm.reconstruct.source import Selection

    rows = {r.trajectory_id: r for r in iter_trajectories(db, selection=Selection(include_side_calls=True))}
    assert {k: (r.role, r.parent_id) for k, r in rows.items()} == {
        "m3": ("main", None),
        "x1": ("side", None),
        "a2": ("subagent", "m3"),  # spawned by m1's Agent call; m1 is trained in row m3
        "c1": ("compaction", "m3"),  # carries the summary m3 sampled
    }
    assert rows["a2"].meta["spawned_by_tool_call"] == "toolu_agent"
    assert rows["a2"].meta["spawned_by_tool"] == "Agent" and rows["a2"].meta["parent_turn_id"] == "m1"
    assert rows["c1"].meta["parent_turn_id"] == "m3"
    assert all(r.reward == 1.0 for r in rows.values())  # broadcast by default


async def test_reward_to_main_and_the_parquet_columns(tmp_path):
    db = tmp_path / "s.sqlite"
    await write(db, claude_code_like_session())
    out = tmp_path / "t.parquet"
    export(db, out, reward_to="main", quiet=True)
    table = pq.read_table(out).to_pylist()
    by_id = {r["trajectory_id"]: r for r in table}
    assert by_id["m3"]["role"] == "main" and by_id["m3"]["reward"] == 1.0 and by_id["m3"]["parent_id"] is None
    assert (
        by_id["a2"]["role"] == "subagent"
        and by_id["a2"]["reward"] is None
        and by_id["a2"]["parent_id"] == "m3"
    )
    assert by_id["c1"]["role"] == "compaction" and by_id["c1"]["reward"] is None
    assert "x1" not in by_id  # side calls stay out unless asked for


async def test_a_single_conversation_is_main_and_a_new_unrelated_one_is_main_too(tmp_path):
    db = tmp_path / "s.sqlite"
    await write(
        db,
        [
            turn("m1", SYSTEM, [7], 1.0, completion(("c1", "Bash"))),
            turn("m2", SYSTEM + [7, 1], [8], 2.0),  # the Bash call answered
            turn("n1", [9000, 9001], [9], 3.0),  # no call open, no summary: another task
        ],
    )
    rows = {r.trajectory_id: (r.role, r.parent_id) for r in iter_trajectories(db)}
    assert rows == {"m2": ("main", None), "n1": ("main", None)}


def facts(id, at, next_at=None, calls=(), output=None, extends=None):
    out = None if output is None else np.asarray(output, dtype="<i4")
    return structure.TurnFacts(id, at, next_at, list(calls), out, extends)


def conv(root, at, turns, prompt=(), tag=None):
    return structure.Conversation(root, at, tag, np.asarray(prompt, dtype="<i4"), turns)


def test_an_agent_tool_wins_over_a_more_recent_open_call():
    main = conv("m1", 0, [facts("m1", 0, None, [("c_agent", "Task")])])
    sub = conv("s1", 1, [facts("s1", 1, None, [("c_bash", "Bash")])])
    second = conv("s2", 2, [facts("s2", 2)])
    links = structure.link([main, sub, second])
    assert (links["s2"].role, links["s2"].parent_turn, links["s2"].tool_call_id) == (
        "subagent",
        "m1",
        "c_agent",
    )


def test_a_call_answered_before_the_conversation_began_is_not_open():
    main = conv("m1", 0, [facts("m1", 0, 1.0, [("c", "Agent")])])
    later = conv("n1", 2, [facts("n1", 2)])
    assert structure.link([main, later])["n1"].role == "main"


def test_compaction_needs_a_whole_token_aligned_window():
    summary = list(range(100, 140))
    main = conv("m1", 0, [facts("m1", 0, output=summary)])
    shifted = np.asarray(summary, dtype="<i4").tobytes()[1:] + b"\0"  # the same bytes, off by one byte
    odd = conv("o1", 1, [facts("o1", 1)], prompt=np.frombuffer(shifted, dtype="<i4"))
    assert structure.link([main, odd])["o1"].role == "main"
    good = conv("g1", 1, [facts("g1", 1)], prompt=[1, 2, *summary[2:38], 3])
    assert structure.link([main, good])["g1"].role == "compaction"


def test_a_background_agent_whose_call_was_answered_at_once_is_a_subagent():
    """Claude Code 2.1.33x runs agents in the background: the Agent call is answered ("launched")
    before the agent's first request, and the main conversation carries on when it ends."""
    main = conv(
        "m1",
        0,
        [facts("m1", 0, 1.0, [("c_agent", "Agent")]), facts("m2", 1.0, 3.0), facts("m3", 3.0)],
    )
    sub = conv("s1", 2, [facts("s1", 2)])
    link = structure.link([main, sub])["s1"]
    assert (link.role, link.parent_turn, link.tool_call_id) == ("subagent", "m1", "c_agent")
    # Without a spawning tool's call it is another conversation, as before.
    bash = conv("b1", 0, [facts("b1", 0, 1.0, [("c", "Bash")]), facts("b2", 1.0, 3.0), facts("b3", 3.0)])
    assert structure.link([bash, conv("s1", 2, [facts("s1", 2)])])["s1"].role == "main"


def test_a_summary_forked_from_the_conversation_links_the_compaction_to_the_turn_before_it():
    """Claude Code 2.1.33x asks for a /compact summary in a fork of the conversation (a branch of
    it), twice when the first reply lacks its tags: the parent is the conversation's newest turn
    that is no summary, not the summary's own branch."""
    summary = list(range(100, 140))
    main = conv(
        "m1",
        0,
        [
            facts("m1", 0, 1.0),
            facts("m2", 1.0, 2.0, extends="m1"),
            facts("m3", 2.0, extends="m2"),  # the answer the conversation ended with
            facts("sum1", 3.0, output=summary, extends="m2"),
            facts("sum2", 4.0, output=summary, extends="m2"),
        ],
    )
    carried = conv("c1", 5, [facts("c1", 5)], prompt=[1, 2, *summary, 3])
    link = structure.link([main, carried])["c1"]
    assert (link.role, link.parent_turn, link.summary_turn) == ("compaction", "m3", "sum2")
    # A summary that extends the whole conversation is its own parent turn, as before.
    chain = conv(
        "m1",
        0,
        [
            facts("m1", 0, 1.0),
            facts("m2", 1.0, 2.0, extends="m1"),
            facts("s", 2.0, output=summary, extends="m2"),
        ],
    )
    assert structure.link([chain, carried])["c1"].parent_turn == "s"


# ---- each mislabelling reported, as the store holds it, in both strategies ---------------------


def structure_of(db, strategy):
    from polar_mitm.reconstruct.source import Selection
    from polar_mitm.reconstruct.stats import ReconstructStats

    stats = ReconstructStats()
    rows = iter_trajectories(db, strategy=strategy, selection=Selection(include_side_calls=True), stats=stats)
    return {r.trajectory_id: (r.role, r.parent_id) for r in rows}, stats


CALL_REPLY = list(range(600, 620))  # a reply long enough to be recognized when repeated


async def test_reactive_compaction_after_a_refused_request_is_a_compaction_not_a_subagent(tmp_path):
    """Claude Code past the policy's context: the request after m2's Bash call is refused
    ("prompt is too long") and never stored, so the call stays open; the harness asks for a
    summary in a branch of the conversation (s1) and carries on with it (c1)."""
    m1_out = [7, 8, 9]
    m2_prompt = SYSTEM + [1, 2] + m1_out + [3, 3]
    db = tmp_path / "s.sqlite"
    await write(
        db,
        [
            turn("m1", SYSTEM + [1, 2], m1_out, 1.0, completion(("toolu_1", "Bash"))),
            turn("m2", m2_prompt, [50, 51], 2.0, completion(("toolu_2", "Bash"))),
            # The summary request: the conversation up to m2's prompt, a summarize instruction.
            turn("s1", m2_prompt + [90, 91], SUMMARY, 3.0),
            turn("c1", [4000, 4001] + SUMMARY[:-1] + [4002], [70], 4.0),
            turn("c2", [4000, 4001] + SUMMARY[:-1] + [4002, 70, 5], [71], 5.0),
        ],
    )
    merged, stats = structure_of(db, "prefix-merge")
    assert merged == {"m2": ("main", None), "s1": ("main", None), "c2": ("compaction", "m2")}
    per, _ = structure_of(db, "per-request")
    assert per == {
        "m1": ("main", None),
        "m2": ("main", None),
        "s1": ("main", None),
        "c1": ("compaction", "m2"),
        "c2": ("compaction", "m2"),
    }
    assert not any(k.startswith("ambiguous") for k in stats.breaks)


async def test_a_summary_request_that_re_renders_the_conversation_continues_it(tmp_path):
    """Claude Code before 2.1.33x: the summary request re-renders the conversation without its
    tools (a new conversation that repeats m2's reply, its Bash call unanswered), and the
    conversation carried on is a compaction of it."""
    m1_out = [7, 8, 9]
    m2_prompt = SYSTEM + [1, 2] + m1_out + [3, 3]
    db = tmp_path / "s.sqlite"
    await write(
        db,
        [
            turn("m1", SYSTEM + [1, 2], m1_out, 1.0, completion(("toolu_1", "Bash"))),
            turn("m2", m2_prompt, CALL_REPLY, 2.0, completion(("toolu_2", "Bash"))),
            turn("s1", [8000, 1, 2] + m1_out + [3] + CALL_REPLY + [91], SUMMARY, 3.0),
            turn("c1", [4000, 4001] + SUMMARY[:-1] + [4002], [70], 4.0),
        ],
    )
    for strategy in ("prefix-merge", "per-request"):
        rows, _ = structure_of(db, strategy)
        assert rows["s1"] == ("main", None)
        assert rows["c1"] == ("compaction", "m2")
        assert "subagent" not in {role for role, _ in rows.values()}


async def test_a_tool_loaded_mid_session_keeps_one_main_conversation(tmp_path):
    """ToolSearch loads a deferred tool: `tools` grows, so turn 2's prompt does not extend turn
    1's, but its request carries ToolSearch's result; then Bash runs as usual."""
    db = tmp_path / "s.sqlite"
    await write(
        db,
        [
            turn("t1", SYSTEM + [1, 2], [7, 8], 1.0, completion(("toolu_search", "ToolSearch"))),
            turn(
                "t2",
                SYSTEM[:-1] + [1999, 1, 2, 7, 8, 3],  # the tools block changed
                [9, 9],
                2.0,
                completion(("toolu_bash", "Bash")),
                request=carrying("toolu_search"),
            ),
            turn("t3", SYSTEM[:-1] + [1999, 1, 2, 7, 8, 3, 9, 9, 4], [10], 3.0),
        ],
    )
    for strategy in ("prefix-merge", "per-request"):
        rows, _ = structure_of(db, strategy)
        assert {role for role, _ in rows.values()} == {"main"}, (strategy, rows)
        assert all(parent is None for _, parent in rows.values())
    merged = {r.trajectory_id: r for r in iter_trajectories(db)}
    assert merged["t3"].meta["continues_turn_id"] == "t1"


async def test_context_moved_to_the_end_is_the_same_conversation(tmp_path):
    """OpenClaw moves its internal-context message to the end of each request: turn 2 does not
    extend turn 1, yet it carries the result of turn 1's call (and repeats its reply)."""
    db = tmp_path / "s.sqlite"
    await write(
        db,
        [
            turn("o1", SYSTEM + [1, 2, 555], CALL_REPLY, 1.0, completion(("call_exec", "exec"))),
            turn(
                "o2",
                SYSTEM + [1, 2] + CALL_REPLY + [3, 555],
                [9, 9],
                2.0,
                completion(("call_exec2", "exec")),
                request=carrying("call_exec"),
            ),
            turn("o3", SYSTEM + [1, 2] + CALL_REPLY + [3, 9, 9, 4, 555], [10], 3.0),
        ],
    )
    for strategy in ("prefix-merge", "per-request"):
        rows, _ = structure_of(db, strategy)
        assert {role for role, _ in rows.values()} == {"main"}, (strategy, rows)


async def test_a_real_subagent_is_one_subagent_row_in_both_strategies(tmp_path):
    db = tmp_path / "s.sqlite"
    await write(db, claude_code_like_session())
    merged, _ = structure_of(db, "prefix-merge")
    assert [k for k, (role, _) in merged.items() if role == "subagent"] == ["a2"]
    per, _ = structure_of(db, "per-request")
    assert per == {
        "m1": ("main", None),
        "x1": ("side", None),
        "a1": ("subagent", "m1"),  # the turn that made the Agent call, a row of its own here
        "a2": ("subagent", "m1"),
        "m2": ("main", None),
        "m3": ("main", None),
        "c1": ("compaction", "m3"),
    }


async def test_reward_to_main_leaves_a_subagent_unrewarded_per_request(tmp_path):
    db = tmp_path / "s.sqlite"
    await write(db, claude_code_like_session())
    rows = {r.trajectory_id: r for r in iter_trajectories(db, strategy="per-request", reward_to="main")}
    assert rows["a1"].reward is None and rows["a2"].reward is None and rows["m2"].reward == 1.0
    assert rows["a1"].meta["spawned_by_tool"] == "Agent"


def test_results_carried_from_two_differently_placed_conversations_are_a_named_break():
    main = conv("m1", 0, [facts("m1", 0, None, [("c_agent", "Agent")])])
    sub = conv("s1", 1, [facts("s1", 1, None, [("c_sub", "Bash")])])
    both = structure.Conversation(
        "b1", 2, None, np.zeros(0, "<i4"), [facts("b1", 2)], frozenset({"c_agent", "c_sub"})
    )
    found = structure.link([main, sub, both])["b1"]
    assert (found.role, found.parent_turn, found.ambiguous) == ("main", None, "ambiguous_continuation")


def test_open_calls_of_several_conversations_spawn_nothing():
    a = conv("a1", 0, [facts("a1", 0, None, [("c1", "Bash")])])
    b = conv("b1", 1, [facts("b1", 1, None, [("c2", "Bash")])])  # no open call before it: main
    c = conv("c1", 2, [facts("c1", 2)])
    links = structure.link([a, b, c])
    assert links["b1"].role == "subagent"  # one conversation had a call open: the weak rule
    assert (links["c1"].role, links["c1"].ambiguous) == ("main", "ambiguous_spawn")


def test_a_forked_subagent_that_repeats_its_parents_history_is_still_a_subagent():
    agent_reply = np.arange(700, 720, dtype="<i4")
    main = conv("m1", 0, [facts("m1", 0, None, [("c_agent", "Agent")], output=agent_reply)])
    fork = conv("f1", 1, [facts("f1", 1)], prompt=[1, *agent_reply[:-1], 2])
    found = structure.link([main, fork])["f1"]
    assert (found.role, found.parent_turn) == ("subagent", "m1")


def test_a_background_fork_that_carries_its_parents_results_is_a_subagent():
    """A forked agent (its parent's history up to the spawning call) whose call was answered at
    once ("launched"): it carries the results of the parent's earlier calls, not the spawn's."""
    main = conv(
        "m1",
        0,
        [
            facts("m1", 0, 1.0, [("c_bash", "Bash")]),
            facts("m2", 1.0, 2.0, [("c_spawn", "spawn_agent")], extends="m1"),
            facts("m3", 2.0, 4.0, extends="m2"),
            facts("m4", 4.0, extends="m3"),
        ],
    )
    fork = structure.Conversation("f1", 3, None, np.zeros(0, "<i4"), [facts("f1", 3)], frozenset({"c_bash"}))
    found = structure.link([main, fork])["f1"]
    assert (found.role, found.parent_turn, found.tool_call_id) == ("subagent", "m2", "c_spawn")
    # A later conversation carrying the newest call's result goes on, an older agent call or not.
    going_on = structure.Conversation(
        "g1", 5, None, np.zeros(0, "<i4"), [facts("g1", 5)], frozenset({"c_late"})
    )
    main.turns.append(facts("m5", 4.5, None, [("c_late", "ToolSearch")], extends="m4"))
    assert structure.link([main, going_on])["g1"].role == "main"
    assert structure.link([main, going_on])["g1"].continues == "m5"


def test_a_forks_own_continuation_goes_on_in_the_fork_not_in_its_parent():
    """A fork carries its parent's older results; its own moved-context turn carries those and the
    result of its own last call: it goes on in the fork (a subagent), nothing ambiguous."""
    main = conv(
        "m1",
        0,
        [
            facts("m1", 0, 1.0, [("c_bash", "Bash")]),
            facts("m2", 1.0, None, [("c_agent", "Agent")], extends="m1"),
            facts("m3", 5.0, extends="m2"),
        ],
    )
    fork = structure.Conversation(
        "f1", 2, None, np.zeros(0, "<i4"), [facts("f1", 2, None, [("c_read", "Read")])], frozenset({"c_bash"})
    )
    moved = structure.Conversation(
        "f2", 3, None, np.zeros(0, "<i4"), [facts("f2", 3)], frozenset({"c_bash", "c_read"})
    )
    links = structure.link([main, fork, moved])
    assert (links["f1"].role, links["f1"].parent_turn) == ("subagent", "m2")
    assert (links["f2"].role, links["f2"].parent_turn, links["f2"].continues) == ("subagent", "m2", "f1")
    assert links["f2"].ambiguous is None

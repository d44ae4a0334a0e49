"""The merge strategies on hand-built turns: exact ids, masks and logprobs, no database."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from polar_mitm.reconstruct.breaks import TokenText, classify_break, common_prefix
from polar_mitm.reconstruct.per_request import per_request
from polar_mitm.reconstruct.prefix_merge import prefix_merge
from polar_mitm.reconstruct.stats import ReconstructStats
from polar_mitm.reconstruct.trajectory import Trajectory
from polar_mitm.store.turn import Turn

# Logprobs exactly representable in float32, so rows compare with ==.
A, B, C, D, E = -0.5, -0.25, -1.0, -0.125, -2.0


class Turns:
    """Builds Turns in creation order (seq 1, 2, …)."""

    def __init__(self, session: str = "s1", task: str | None = "task-1"):
        self.session, self.task = session, task
        self.made: list[Turn] = []

    def __call__(
        self,
        tid: str,
        prompt: list[int],
        output: list[int],
        logprobs: list[float] | None = None,
        *,
        ref: str | None = None,
        ref_len: int = 0,
        session: str | None = None,
        tag: str | None = None,
        status: str = "ok",
        finish: str | None = "stop",
        wv: str | None = "w1",
    ) -> Turn:
        turn = Turn(
            id=tid,
            session_id=session or self.session,
            seq=len(self.made) + 1,
            created_at=1000.0 + len(self.made),
            style="anthropic",
            model="policy",
            tag=tag,
            status=status,
            finish_reason=finish,
            prompt_ids=prompt,
            output_ids=output,
            output_logprobs=logprobs if logprobs is not None else [A] * len(output),
            prompt_ref=ref,
            prompt_ref_len=ref_len,
            weight_version=wv,
            task_id=self.task,
        )
        self.made.append(turn)
        return turn


def row_of(rows: list[Trajectory], tid: str) -> Trajectory:
    (row,) = [r for r in rows if r.trajectory_id == tid]
    return row


def check(
    row: Trajectory, prompt: list[int], response: list[int], mask: list[int], logprobs: list[float]
) -> None:
    assert row.prompt_ids.tolist() == prompt
    assert row.response_ids.tolist() == response
    assert row.loss_mask.tolist() == mask
    assert row.response_logprobs.tolist() == logprobs
    assert row.prompt_ids.dtype == np.int32 and row.loss_mask.dtype == np.int8
    assert row.response_logprobs.dtype == np.float32


def merge(turns: list[Turn], **kw) -> tuple[list[Trajectory], ReconstructStats]:
    stats = ReconstructStats()
    return list(prefix_merge(turns, stats=stats, **kw)), stats


# --- linear chain -------------------------------------------------------------------------------


def linear_chain(hints: bool = True) -> list[Turn]:
    t = Turns()
    t("t1", [1, 2, 3], [10, 11], [A, B])
    t("t2", [1, 2, 3, 10, 11, 4, 5], [12], [C], ref="t1" if hints else None, ref_len=5)
    t(
        "t3",
        [1, 2, 3, 10, 11, 4, 5, 12, 6],
        [13, 14],
        [D, A],
        ref="t2" if hints else None,
        ref_len=8,
        finish="length",
    )
    return t.made


@pytest.mark.parametrize("hints", [True, False])
def test_linear_chain_is_one_row(hints: bool) -> None:
    rows, stats = merge(linear_chain(hints))
    (row,) = rows
    check(
        row,
        prompt=[1, 2, 3],
        response=[10, 11, 4, 5, 12, 6, 13, 14],
        mask=[1, 1, 0, 0, 1, 0, 1, 1],
        logprobs=[A, B, 0, 0, C, 0, D, A],
    )
    assert row.trajectory_id == "t3" and row.turn_ids == ["t1", "t2", "t3"] and row.num_turns == 3
    assert row.finish_reason == "length" and row.session_id == "s1" and row.task_id == "task-1"
    meta = json.loads(row.metadata)
    assert meta["strategy"] == "prefix-merge" and meta["weight_versions"] == ["w1"]
    assert meta["breaks"] == [] and meta["branched_from"] is None
    assert stats.breaks == {} and stats.mismatches == {} and stats.branches == 0


def test_a_hint_the_tokens_contradict_is_not_trusted() -> None:
    t = Turns()
    t("t1", [1, 2], [10], [A])
    t("t2", [1, 2, 10, 3], [11], [B], ref="t1", ref_len=3)
    # Claims to extend t2's sequence [1,2,10,3,11], but its tokens differ at position 3.
    t("t3", [1, 2, 10, 9, 11, 4], [12], [C], ref="t2", ref_len=5)
    rows, stats = merge(t.made)
    assert stats.mismatches["hint_unverified"] == 1
    # It still branches from t1, whose sequence it does extend.
    check(row_of(rows, "t3"), [1, 2], [10, 9, 11, 4, 12], [1, 0, 0, 0, 1], [A, 0, 0, 0, C])
    assert row_of(rows, "t3").turn_ids == ["t1", "t3"]


def test_rewards_go_to_each_trajectory_of_the_session() -> None:
    t = Turns()
    t("a1", [1], [2], session="a")
    t("b1", [5], [6], session="b")
    t("a2", [1, 2, 3], [4], session="a")
    rows, _ = merge(t.made, rewards={"a": 1.0, "b": None})
    assert [(r.trajectory_id, r.reward, r.turn_ids) for r in rows] == [
        ("a2", 1.0, ["a1", "a2"]),
        ("b1", None, ["b1"]),
    ]


# --- fork (subagent / parallel calls) -----------------------------------------------------------


def test_fork_trains_shared_tokens_once_on_the_longest_branch() -> None:
    t = Turns()
    t("t1", [1, 2], [10, 11], [A, B])
    t("t2", [1, 2, 10, 11, 3], [12, 13, 14], [C, D, E], ref="t1", ref_len=4)  # main line
    t("t3", [1, 2, 10, 11, 5], [20], [D], ref="t1", ref_len=4)  # forked from t1
    t("t4", [1, 2, 10, 11, 3, 12, 13, 14, 6], [15], [A], ref="t2", ref_len=8)
    rows, stats = merge(t.made)
    assert [r.trajectory_id for r in rows] == ["t3", "t4"]  # leaves, in creation order
    main, fork = row_of(rows, "t4"), row_of(rows, "t3")
    check(
        main,
        prompt=[1, 2],
        response=[10, 11, 3, 12, 13, 14, 6, 15],
        mask=[1, 1, 0, 1, 1, 1, 0, 1],
        logprobs=[A, B, 0, C, D, E, 0, A],
    )
    # The fork carries t1's sampled tokens as untrained context.
    check(fork, prompt=[1, 2, 10, 11, 5], response=[20], mask=[1], logprobs=[D])
    assert fork.turn_ids == ["t1", "t3"] and main.turn_ids == ["t1", "t2", "t4"]
    meta = json.loads(fork.metadata)
    assert meta["branched_from"] == "t1" and meta["trained_from"] == 4
    assert stats.branches == 1 and stats.breaks == {} and stats.mismatches == {}


def test_fork_tie_goes_to_the_earliest_branch() -> None:
    t = Turns()
    t("t1", [1], [10], [A])
    t("t2", [1, 10, 2], [20], [B], ref="t1", ref_len=2)
    t("t3", [1, 10, 3], [30], [C], ref="t1", ref_len=2)
    rows, _ = merge(t.made)
    check(row_of(rows, "t2"), [1], [10, 2, 20], [1, 0, 1], [A, 0, B])
    check(row_of(rows, "t3"), [1, 10, 3], [30], [1], [C])


def test_nested_forks_train_every_sampled_token_exactly_once() -> None:
    t = Turns()
    t("r", [1], [2, 3], [A, B])
    t("x", [1, 2, 3, 4], [5], [C])
    t("y", [1, 2, 3, 6], [7, 8, 9], [D, E, A])
    t("y1", [1, 2, 3, 6, 7, 8, 9, 1], [11], [B])
    t("y2", [1, 2, 3, 6, 7, 8, 9, 2], [12, 13], [C, D])
    rows, stats = merge(t.made)
    check(row_of(rows, "x"), [1, 2, 3, 4], [5], [1], [C])
    check(row_of(rows, "y1"), [1, 2, 3, 6, 7, 8, 9, 1], [11], [1], [B])
    # y2 is the longest leaf: it trains r, y and itself.
    check(
        row_of(rows, "y2"),
        [1],
        [2, 3, 6, 7, 8, 9, 2, 12, 13],
        [1, 1, 0, 1, 1, 1, 0, 1, 1],
        [A, B, 0, D, E, A, 0, C, D],
    )
    assert stats.branches == 2
    assert sum(r.num_trained for r in rows) == sum(len(x.output_ids) for x in t.made)


# --- compaction break ---------------------------------------------------------------------------


def test_compaction_starts_a_new_trajectory() -> None:
    t = Turns()
    t("t1", [1, 2, 3], [10, 11], [A, B])
    t("t2", [1, 2, 3, 10, 11, 4], [12], [C], ref="t1", ref_len=5)
    t("t3", [1, 2, 7, 8], [30, 31], [D, E])  # same system prompt, a summary instead of history
    t("t4", [1, 2, 7, 8, 30, 31, 9], [32], [A], ref="t3", ref_len=6)
    rows, stats = merge(t.made)
    assert [r.trajectory_id for r in rows] == ["t2", "t4"]
    check(row_of(rows, "t2"), [1, 2, 3], [10, 11, 4, 12], [1, 1, 0, 1], [A, B, 0, C])
    check(row_of(rows, "t4"), [1, 2, 7, 8], [30, 31, 9, 32], [1, 1, 0, 1], [D, E, 0, A])
    (brk,) = json.loads(row_of(rows, "t4").metadata)["breaks"]
    assert brk == {
        "turn_id": "t3",
        "class": "unknown",  # no tokenizer: the text cannot be compared
        "at": "new-trajectory",
        "vs_turn": "t1",
        "common_prefix": 2,
        "in_sampled": False,
    }
    assert stats.breaks == {"unknown": 1} and stats.mismatches == {}


def test_compaction_with_a_decoder_is_other() -> None:
    vocab = {1: "<s>", 2: "sys", 3: "hi", 7: "summary", 8: "go", 10: "a", 11: "b", 4: "t", 12: "c", 30: "x"}
    t = Turns()
    t("t1", [1, 2, 3], [10, 11], [A, B])
    t("t3", [1, 2, 7, 8], [30], [D])
    text = TokenText(template_ids={1}, decode=lambda ids: "".join(vocab[i] for i in ids))
    _, stats = merge(t.made, text=text)
    assert stats.breaks == {"other": 1}


def test_unrelated_conversation_is_an_other_break() -> None:
    t = Turns()
    t("t1", [1, 2], [3])
    t("t2", [5, 6], [7])
    rows, stats = merge(t.made)
    assert len(rows) == 2 and stats.breaks == {"other": 1}


# --- retries ------------------------------------------------------------------------------------


def test_retry_keeps_the_turn_that_was_continued() -> None:
    t = Turns()
    t("t1", [1, 2], [10], [A])
    t("t1b", [1, 2], [11], [B])  # same request again, different sample
    t("t2", [1, 2, 10, 5], [12], [C], ref="t1", ref_len=3)  # the conversation went on from t1
    rows, stats = merge(t.made)
    (row,) = rows
    check(row, [1, 2], [10, 5, 12], [1, 0, 1], [A, 0, C])
    assert row.turn_ids == ["t1", "t2"]
    assert stats.retries_dropped == 1 and stats.branches == 0 and stats.breaks == {}
    assert json.loads(row.metadata)["retries_dropped"] == 1


def test_retry_without_continuation_keeps_the_newest() -> None:
    t = Turns()
    t("t0", [1], [2], [A])
    t("t1", [1, 2, 3], [10], [B], ref="t0", ref_len=2)
    t("t1b", [1, 2, 3], [11], [C], ref="t0", ref_len=2)
    t("t1c", [1, 2, 3], [12], [D], ref="t0", ref_len=2)
    rows, stats = merge(t.made)
    (row,) = rows
    assert row.trajectory_id == "t1c" and row.turn_ids == ["t0", "t1c"]
    check(row, [1], [2, 3, 12], [1, 0, 1], [A, 0, D])
    assert stats.retries_dropped == 2


# --- template and retokenization breaks ---------------------------------------------------------

THINK, END_THINK, EOS = 100, 101, 99


def test_template_break_thinking_stripped_from_history() -> None:
    t = Turns()
    t("t1", [1, 2, 3], [THINK, 20, 21, END_THINK, 22, EOS], [A, B, C, D, E, A])
    # The template re-rendered t1's reply without its thinking: the prompt no longer extends t1.
    t("t2", [1, 2, 3, 22, EOS, 4], [23, EOS], [B, C], ref="t1", ref_len=3)
    text = TokenText(template_ids={1, THINK, END_THINK, EOS})
    rows, stats = merge(t.made, text=text)
    check(row_of(rows, "t1"), [1, 2, 3], [THINK, 20, 21, END_THINK, 22, EOS], [1] * 6, [A, B, C, D, E, A])
    check(row_of(rows, "t2"), [1, 2, 3, 22, EOS, 4], [23, EOS], [1, 1], [B, C])
    (brk,) = json.loads(row_of(rows, "t2").metadata)["breaks"]
    assert brk["class"] == "template" and brk["common_prefix"] == 3 and brk["in_sampled"]
    assert stats.breaks == {"template": 1} and stats.mismatches == {"sampled_rewrite": 1}


def test_retokenization_break_inside_a_branch() -> None:
    vocab = {1: "<s>", 2: "sys", 3: "q", 10: "hel", 11: "lo", 12: "hello", 4: "tool", 5: "more", 13: "ok"}
    vocab[EOS] = "</s>"
    text = TokenText(template_ids={1, EOS}, decode=lambda ids: "".join(vocab[i] for i in ids))
    t = Turns()
    t("t0", [1, 2], [3], [A])
    t("t1", [1, 2, 3, 5], [10, 11, EOS], [B, C, D], ref="t0", ref_len=3)
    # "hello" came back as one token: extends t0, diverges inside t1's sampled tokens.
    t("t2", [1, 2, 3, 5, 12, EOS, 4], [13], [E], ref="t1", ref_len=4)
    rows, stats = merge(t.made, text=text)
    assert [r.trajectory_id for r in rows] == ["t1", "t2"]
    check(row_of(rows, "t2"), [1, 2], [3, 5, 12, EOS, 4, 13], [1, 0, 0, 0, 0, 1], [A, 0, 0, 0, 0, E])
    check(row_of(rows, "t1"), [1, 2, 3, 5], [10, 11, EOS], [1, 1, 1], [B, C, D])
    (brk,) = json.loads(row_of(rows, "t2").metadata)["breaks"]
    assert brk == {
        "turn_id": "t2",
        "class": "retokenization",
        "at": "branch",
        "vs_turn": "t1",
        "common_prefix": 4,
        "in_sampled": True,
    }
    assert stats.breaks == {"retokenization": 1} and stats.mismatches == {"sampled_rewrite": 1}


def test_retokenization_break_new_trajectory() -> None:
    vocab = {1: "<s>", 2: "sys", 3: "q", 10: "hel", 11: "lo", 12: "hello", 4: "tool", 13: "ok", EOS: "</s>"}
    text = TokenText(template_ids={1, EOS}, decode=lambda ids: "".join(vocab[i] for i in ids))
    t = Turns()
    t("t1", [1, 2, 3], [10, 11, EOS], [A, B, C])
    t("t2", [1, 2, 3, 12, EOS, 4], [13], [D])
    rows, stats = merge(t.made, text=text)
    check(row_of(rows, "t2"), [1, 2, 3, 12, EOS, 4], [13], [1], [D])
    assert stats.breaks == {"retokenization": 1}
    # Without a decoder the same break cannot be told from a content change.
    _, stats = merge(t.made)
    assert stats.breaks == {"unknown": 1}


def test_stop_tokens_are_template_tokens_without_a_tokenizer() -> None:
    t = Turns()
    t("t1", [1, 2], [10, EOS], [A, B])
    t("t2", [1, 2, 10, 7, 4], [13], [C])  # EOS replaced by something else right after the reply
    _, stats = merge(t.made)
    assert stats.breaks == {"template": 1}


def test_classify_break_with_the_tiny_tokenizer(tiny_tokenizer_dir) -> None:
    from polar_mitm.backends.tokenizer import Tokenizer

    tok = Tokenizer.load(tiny_tokenizer_dir)
    text = TokenText.load(tiny_tokenizer_dir)
    im_end = tok.token_id("<|im_end|>")
    assert im_end in text.template_ids
    head = tok.encode("<|im_start|>user\nsay it<|im_end|>\n<|im_start|>assistant\n")
    whole = tok.encode("hello there")
    pieces = [i for ch in "hello there" for i in tok.encode(ch)]
    assert whole != pieces and tok.decode(whole) == tok.decode(pieces)
    old = head + pieces + [im_end]
    new = head + whole + [im_end] + tok.encode("\n<|im_start|>user\nthanks")
    k = common_prefix(np.array(old), np.array(new))
    assert classify_break(old, new, k, in_sampled=True, text=text) == "retokenization"
    changed = head + tok.encode("goodbye") + [im_end]
    k = common_prefix(np.array(old), np.array(changed))
    assert classify_break(old, changed, k, in_sampled=True, text=text) == "other"
    think = tok.token_id("<think>")
    assert think in text.template_ids
    thinking = head + [think] + tok.encode("\nhmm\n") + [tok.token_id("</think>")] + whole + [im_end]
    stripped = head + whole + [im_end] + tok.encode("\n<|im_start|>user\nthanks")
    assert classify_break(thinking, stripped, len(head), in_sampled=True, text=text) == "template"


# --- odds and ends ------------------------------------------------------------------------------


def test_a_prompt_inside_an_earlier_sequence_is_a_rewind_not_a_break() -> None:
    t = Turns()
    t("t1", [1, 2, 3], [4, 5], [A, B])
    t("t2", [1, 2, 3, 4], [9], [C])  # prefilled with part of t1's reply
    rows, stats = merge(t.made)
    check(row_of(rows, "t2"), [1, 2, 3, 4], [9], [1], [C])
    assert stats.breaks == {} and stats.mismatches == {}


def test_logprob_count_mismatch_is_padded_and_counted() -> None:
    t = Turns()
    t("t1", [1], [2, 3, 4], [A])
    rows, stats = merge(t.made)
    check(rows[0], [1], [2, 3, 4], [1, 1, 1], [A, 0, 0])
    assert stats.mismatches == {"logprob_length": 1}


def test_per_request_rows_are_the_engine_calls() -> None:
    stats = ReconstructStats()
    rows = list(per_request(linear_chain(), rewards={"s1": 0.5}, stats=stats))
    assert [r.trajectory_id for r in rows] == ["t1", "t2", "t3"]
    check(rows[1], [1, 2, 3, 10, 11, 4, 5], [12], [1], [C])
    check(rows[2], [1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14], [1, 1], [D, A])
    assert all(r.reward == 0.5 and r.num_turns == 1 for r in rows)
    assert json.loads(rows[0].metadata)["strategy"] == "per-request"


def test_empty_input_gives_no_rows() -> None:
    assert merge([])[0] == []


@pytest.mark.parametrize("seed", range(40))
def test_random_trees_keep_the_invariants(seed: int) -> None:
    """Random conversations with forks, retries and restarts: every row is token-exact and every
    kept sampled token is trained exactly once."""
    rng = random.Random(seed)
    t = Turns()
    seqs: list[tuple[str, list[int]]] = []  # (turn id, full sequence)
    for i in range(rng.randint(1, 25)):
        roll = rng.random()
        if not seqs or roll < 0.1:
            prompt = [rng.randint(1, 5) for _ in range(rng.randint(0, 4))]  # new conversation
            ref, ref_len = None, 0
        elif roll < 0.25:
            earlier = rng.choice(t.made)  # the same request again
            prompt, ref, ref_len = list(earlier.prompt_ids), earlier.prompt_ref, earlier.prompt_ref_len
        else:
            ref, base = rng.choice(seqs[-3:] if rng.random() < 0.7 else seqs)
            prompt = base + [rng.randint(1, 5) for _ in range(rng.randint(0, 3))]
            ref_len = len(base)
        output = [rng.randint(1, 5) for _ in range(rng.randint(0, 3))]
        logprobs = [-float(rng.randint(1, 8)) / 8 for _ in output]
        turn = t(f"t{i}", prompt, output, logprobs, ref=ref, ref_len=ref_len)
        seqs.append((turn.id, prompt + output))
    rows, stats = merge(t.made)
    by_id = {x.id: x for x in t.made}
    kept: set[str] = set()
    for row in rows:
        full = row.prompt_ids.tolist() + row.response_ids.tolist()
        assert len(row.loss_mask) == len(row.response_ids) == len(row.response_logprobs)
        assert row.loss_mask.tolist()[:1] in ([], [1])
        last = by_id[row.trajectory_id]
        assert full == last.prompt_ids + last.output_ids
        for tid in row.turn_ids:
            turn = by_id[tid]
            assert full[: len(turn.prompt_ids) + len(turn.output_ids)] == turn.prompt_ids + turn.output_ids
            kept.add(tid)
        assert (row.response_logprobs[row.loss_mask == 0] == 0).all()
    assert sum(r.num_trained for r in rows) == sum(len(by_id[x].output_ids) for x in kept)
    assert len(kept) == len(t.made) - stats.retries_dropped

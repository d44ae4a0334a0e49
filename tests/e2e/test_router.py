"""Real Claude Code through `polar-mitm run --backend ROUTER`: SGLang's real router
(`sglang-router` from PyPI) in front of two fake engines, all on 127.0.0.1.

Under the router's `manual` policy every turn of a conversation is served by one engine (read
from the engines' own request logs, by the routing key polar-mitm sends); under `cache_aware`
sessions complete (Claude Code and Codex both, under both policies); `run` started while the router has no worker waits, says so once, and works
when one registers.
"""

from __future__ import annotations

import subprocess
from collections import defaultdict

import pytest

from tests.support.harness import POLAR, FakeBackend, harness_env, main_turns, polar_run, require_binary
from tests.support.routers import Router, require_router

pytestmark = pytest.mark.e2e

TASK = ["claude", "-p", "Create out.txt containing hi", "--allowedTools", "Bash"]


@pytest.fixture
def engines(qwen_tokenizer_dir):
    """Two fake engines in their own processes (model path: their tokenizer directory, which the
    router loads)."""
    started = [FakeBackend(qwen_tokenizer_dir, "--model-path", str(qwen_tokenizer_dir)) for _ in range(2)]
    yield started
    for e in started:
        e.stop()


def policy_args(url: str, tok, db) -> list[str]:
    return ["--backend", url, "--tokenizer", str(tok), "--tool-parser", "qwen25", "--db", str(db)]


def served_by(engines: list[FakeBackend]) -> tuple[dict[str, set[str]], dict[str, int]]:
    """routing key -> the engines whose logs show a /generate with it, and how many they show."""
    where: dict[str, set[str]] = defaultdict(set)
    count: dict[str, int] = defaultdict(int)
    for e in engines:
        for r in e.get("/_fake/requests")["requests"]:
            if r["path"] == "/generate":
                where[r["routing_key"]].add(e.url)
                count[r["routing_key"]] += 1
    return where, count


def claude_session(tmp_path, name: str, url: str, tok) -> None:
    work, db = tmp_path / name, tmp_path / f"{name}.sqlite"
    work.mkdir()
    r = polar_run(
        [*policy_args(url, tok, db), "--session", name],
        TASK,
        cwd=work,
        env=harness_env(tmp_path / f"home-{name}"),
    )
    assert r.returncode == 0, r.stderr
    assert (work / "out.txt").read_text() == "hi\n"
    assert "is an SGLang router with 2 worker(s)" in r.stderr
    t1, t2 = main_turns(db)
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids


def test_claude_code_under_manual_policy_keeps_each_conversation_on_one_engine(
    tmp_path, engines, qwen_tokenizer_dir
):
    require_binary("claude")
    require_router()
    router = Router("manual")
    try:
        for e in engines:
            router.add(e.url)
        for i in range(4):
            claude_session(tmp_path, f"cc-manual-{i}", router.url, qwen_tokenizer_dir)
        where, count = served_by(engines)
        assert None not in where  # every generation carried a routing key
        conversations = [k for k, n in count.items() if n >= 2]  # side calls may be single
        assert len(conversations) >= 4, count  # each session's two-turn conversation
        assert all(len(urls) == 1 for urls in where.values()), where  # each on one engine
    finally:
        router.stop()


def test_claude_code_under_cache_aware_policy_completes(tmp_path, engines, qwen_tokenizer_dir):
    require_binary("claude")
    require_router()
    router = Router("cache_aware")
    try:
        for e in engines:
            router.add(e.url)
        claude_session(tmp_path, "cc-cache-aware", router.url, qwen_tokenizer_dir)
    finally:
        router.stop()


def test_run_started_before_the_router_has_workers_waits_then_works(tmp_path, engines, qwen_tokenizer_dir):
    require_binary("claude")
    require_router()
    router = Router("manual")
    work, db = tmp_path / "work", tmp_path / "runs.sqlite"
    work.mkdir()
    try:
        proc = subprocess.Popen(
            [
                *POLAR,
                "run",
                *policy_args(router.url, qwen_tokenizer_dir, db),
                "--backend-wait",
                "60",
                "--",
                *TASK,
            ],
            cwd=work,
            env=harness_env(tmp_path / "home"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        before: list[str] = []  # what run wrote until it said it waits
        while "has no worker yet" not in (line := proc.stderr.readline()):
            assert line, "run ended before waiting for a worker: " + "".join(before)
            before.append(line)
        before.append(line)
        assert proc.poll() is None  # still waiting, not refused
        for e in engines:
            router.add(e.url)
        out, err = proc.communicate(timeout=240)
        err = "".join(before) + err
        assert proc.returncode == 0, err
        assert err.count("has no worker yet") == 1  # one line of progress
        assert (work / "out.txt").read_text() == "hi\n"
        assert len(main_turns(db)) == 2
    finally:
        router.stop()


@pytest.mark.parametrize("policy", ["manual", "cache_aware"])
def test_codex_through_the_router_completes(tmp_path, engines, qwen_tokenizer_dir, policy):
    from tests.e2e.test_codex import run_codex

    require_binary("codex")
    require_router()
    router = Router(policy)
    try:
        for e in engines:
            router.add(e.url)
        db = run_codex(tmp_path, router, qwen_tokenizer_dir, f"codex-{policy}")
        t1, t2 = main_turns(db)
        assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
        where, count = served_by(engines)
        assert None not in where and sum(count.values()) >= 2
        if policy == "manual":
            assert all(len(urls) == 1 for urls in where.values()), where
    finally:
        router.stop()

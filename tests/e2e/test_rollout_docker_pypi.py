"""Rollouts in real Docker containers of the PyPI harnesses: mini-swe-agent, aider, Kimi CLI,
OpenHands, hermes-agent and gptme, through `polar-mitm rollout` with each recipe's headless command and a Harbor task
scored by its own test.

Each harness's virtualenv and the pyenv interpreter it was built on are mounted read-only at the
host's own paths (harness/install.py), with a bin directory of links to its entry scripts; the
harness runs as the unprivileged harness user, with no network but its channel to the proxy (the
forwarder runs on the mounted interpreter), and honours HTTPS_PROXY and our CA through the
recipe's variables. The fake backend answers "run: CMD" with a call to the harness's shell tool
(mini-swe-agent's `bash`, Kimi's `Shell`, OpenHands' and hermes-agent's `terminal`); aider has no tools, so its
script writes the file in aider's default (diff) edit format, and its commit message is a side call.
"""

from __future__ import annotations

import json
import sqlite3

import pytest

from polar_mitm import recipes
from polar_mitm.store.reader import read_turns
from tests.support.docker_rollout import leftovers, solve_answer_task
from tests.support.harness import FakeBackend, assert_turns_match_backend, require_binary

pytestmark = [pytest.mark.e2e, pytest.mark.docker, pytest.mark.slow]

RUN = {"match": "run: (.+)", "shell": "\\1"}
# mini-swe-agent ends only on its submit command (a reply in text is a format error to it).
MINI = [{"match": "<tool_response>", "shell": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}, RUN]
COMMIT = "feat: add answer.txt"
AIDER = [
    {"match": "one-line Git commit messages", "in": "prompt", "text": COMMIT},
    # aider's `diff` edit format (its default for gpt-4o): the file name, then a fenced
    # SEARCH/REPLACE block; an empty SEARCH creates the file.
    {
        "match": r"[Cc]reate ([^\s\"'`]+) containing ([^\s\"'`]+)",
        "text": "\\1\n```\n<<<<<<< SEARCH\n=======\n\\2\n>>>>>>> REPLACE\n```",
    },
]
SHELL_TASK = "run: echo 42 > answer.txt"
# gptme ends only when the model calls its `complete` tool.
GPTME = [{"match": "<tool_response>", "tool_call": {"name": "complete", "arguments": {}}}, RUN]

CASES = {
    # harness: (binary, the fake's script (None: its default), instruction, the main turns' tool)
    "mini-swe-agent": ("mini", MINI, SHELL_TASK, "bash"),
    "aider": ("aider", AIDER, "Create answer.txt containing 42", None),
    "kimi-cli": ("kimi", None, SHELL_TASK, "Shell"),
    "openhands": ("openhands", None, SHELL_TASK, "terminal"),
    "hermes-agent": ("hermes", None, SHELL_TASK, "terminal"),  # its Anthropic provider (the recipe's)
    "gptme": ("gptme", GPTME, SHELL_TASK, "shell"),  # its titles are side calls
}


@pytest.mark.parametrize("harness", list(CASES))
def test_pypi_harness_solves_a_task_in_docker(tmp_path, qwen_tokenizer_dir, docker_client, harness):
    binary, script, instruction, tool = CASES[harness]
    require_binary(binary)
    extra: list[str] = []
    if script is not None:
        (tmp_path / "script.json").write_text(json.dumps(script))
        extra = ["--script", str(tmp_path / "script.json")]
    backend = FakeBackend(qwen_tokenizer_dir, *extra)
    try:
        db, rows = solve_answer_task(tmp_path, harness, backend, qwen_tokenizer_dir, instruction)
        assert all(row["role"] == "main" for row in rows)  # side calls are tagged, not trajectories
        assert_turns_match_backend(backend, db)  # token-exact: ids and logprobs are the engine's
        turns = read_turns(db, with_raw=True)
        con = sqlite3.connect(db)
        assert con.execute("SELECT COUNT(DISTINCT session_id) FROM turns").fetchone() == (2,)
        hosts = {h for (h,) in con.execute("SELECT DISTINCT host FROM turns")}
        assert hosts and hosts <= set(recipes.get(harness).hosts)  # the harness's own provider host
        if tool is not None:  # each sample's first turn called the harness's shell tool
            firsts: dict = {}
            for t in turns:  # (in the order they were stored)
                if t.tag is None:
                    firsts.setdefault(t.session_id, t)
            assert len(firsts) == 2 and {t.finish_reason for t in firsts.values()} == {"tool_calls"}
            assert {json.loads(t.response)["tool_calls"][0]["name"] for t in firsts.values()} == {tool}
        else:  # aider: one main turn per sample, and its commit message tagged as a side call
            assert sorted(t.tag or "main" for t in turns) == ["commit-message"] * 2 + ["main"] * 2
        assert leftovers(docker_client) == []
    finally:
        backend.stop()


# hermes-agent's other providers (the recipe's command uses its Anthropic one): --provider -> (its
# model, the host its turns are stored under). Gemini's client trusts only HERMES_CA_BUNDLE, which
# the recipe sets in the container as on the host.
HERMES_PROVIDERS = {
    "openai-api": ("gpt-4o", "api.openai.com"),
    "gemini": ("gemini-2.5-flash", "generativelanguage.googleapis.com"),
    "openrouter": ("openai/gpt-4o", "openrouter.ai"),
}


@pytest.mark.parametrize("provider", list(HERMES_PROVIDERS))
def test_hermes_agents_other_providers_solve_a_task_in_docker(
    tmp_path, qwen_tokenizer_dir, docker_client, provider
):
    require_binary("hermes")
    model, host = HERMES_PROVIDERS[provider]
    cmd = f"hermes -z {{instruction}} --provider {provider} -m {model} --yolo"
    backend = FakeBackend(qwen_tokenizer_dir)
    try:
        db, rows = solve_answer_task(
            tmp_path, "hermes-agent", backend, qwen_tokenizer_dir, SHELL_TASK, extra=["--harness-cmd", cmd]
        )
        assert all(row["role"] == "main" for row in rows)
        assert_turns_match_backend(backend, db)
        con = sqlite3.connect(db)
        assert {h for (h,) in con.execute("SELECT DISTINCT host FROM turns")} == {host}
        assert leftovers(docker_client) == []
    finally:
        backend.stop()

"""The real Cline CLI (npm cline), unmodified, through `polar-mitm run` with the recipe's headless
command: OpenAI Responses over SSE, its `run_commands` tool called by the fake's default script."""

import sqlite3
import subprocess

import pytest

from tests.support.harness import require_binary, run_tool_task

pytestmark = pytest.mark.e2e


def test_run_commands_task_is_done_and_every_turn_is_captured_token_exact(
    tmp_path, backend, qwen_tokenizer_dir
):
    require_binary("cline")
    task = run_tool_task(
        "cline",
        backend,
        qwen_tokenizer_dir,
        tmp_path,
        "cline-e2e",
        style="openai-responses",
        host="api.openai.com",
    )
    work = task.work
    assert "Done. The command finished." in task.result.stdout
    assert "session cline-e2e" in task.result.stderr and "2 turns" in task.result.stderr
    assert task.call["name"] == "run_commands" and task.call["arguments"]["commands"] == [
        "printf '%s\\n' 'hi' > 'out.txt'"
    ]
    con = sqlite3.connect(task.db)
    # The API key flag's value is not stored.
    [(command,)] = con.execute("SELECT command FROM sessions").fetchall()
    assert "sk-polar-mitm-dummy" not in command and "[redacted]" in command
    # No background hub daemon outlives the run (it would keep this run's proxy address).
    ps = subprocess.run(["ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True).stdout
    left = [
        line.split(None, 1) for line in ps.splitlines() if "--cline-hub-daemon" in line and str(work) in line
    ]
    for pid, _ in left:  # ours (started in this test's work directory): do not leave it running
        subprocess.run(["kill", pid], check=False)
    assert not left

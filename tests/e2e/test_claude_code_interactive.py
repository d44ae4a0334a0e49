"""Claude Code's interactive terminal UI, unmodified, through `polar-mitm run`, driven in tmux.

Its first-run screens (theme, security notes, folder trust) are answered as a user would, the
prompt is typed, and the tool call and answer must appear on screen and in the store. With its
nonessential traffic on (the recipe turns it off), Claude Code also names the session in a call
of its own ("You are naming a coding session…" since 2.1.33x): stored as a side call, never a
main row.
"""

import shutil
import subprocess
import time

import pytest

from polar_mitm.store.reader import read_turns
from tests.support.harness import POLAR, harness_env, main_turns, require_binary

pytestmark = pytest.mark.e2e


def screen(name: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-t", name, "-p"], capture_output=True, text=True).stdout


def keys(name: str, *k: str) -> None:
    subprocess.run(["tmux", "send-keys", "-t", name, *k], check=True)


# The session-title prompt: 2.1.33x's, then the one before.
TITLE_PROMPTS = ("You are naming a coding session", "Generate a concise")


@pytest.mark.parametrize("nonessential", [False, True], ids=["recipe", "titles-on"])
def test_interactive_session_through_the_proxy(tmp_path, backend, qwen_tokenizer_dir, nonessential):
    require_binary("claude")
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed; scripts/install.sh installs it")
    work, db, name = tmp_path / "work", tmp_path / "runs.sqlite", f"polar-{tmp_path.name}"
    work.mkdir()
    env = harness_env(tmp_path / "home")
    cmd = [
        *POLAR,
        "run",
        "--backend",
        backend.url,
        "--tokenizer",
        str(qwen_tokenizer_dir),
        "--db",
        str(db),
        "--",
        *(["env", "-u", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] if nonessential else []),
        "claude",
        "--allowedTools",
        "Bash",
    ]
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", name, "-x", "200", "-y", "50", *cmd],
        cwd=work,
        env=env,
        check=True,
    )
    typed = False
    seen: list[str] = []  # every screen: a redraw under load can hide the tool call by the end
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            time.sleep(1.5)
            s = screen(name)
            seen.append(s)
            if "Done. The command finished." in s:
                break
            if typed:
                continue
            # The prompt box is ready ("? for shortcuts"; 2.1.33x shows its permission mode there).
            if "? for shortcuts" in s or "shift+tab to cycle" in s:
                keys(name, "Create tui.txt containing yo")
                time.sleep(0.5)
                keys(name, "Enter")
                typed = True
            elif "❯ No, exit" in s:  # 2.1.33x's folder trust screen starts on "No": go down to "Yes"
                keys(name, "Down")
            elif "Enter to confirm" in s or "Press Enter" in s or "Choose the text style" in s:
                keys(name, "Enter")  # first-run screens: default theme, notes, trust this folder
        else:
            pytest.fail("no answer on screen:\n" + screen(name))
        # The tool call as shown: "Bash(printf …)", or 2.1.33x's folded "Ran 1 shell command".
        assert any("Bash(printf" in s or "Ran 1 shell command" in s for s in [*seen, screen(name)])
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
    assert (work / "tui.txt").read_text() == "yo\n"
    t1, t2 = main_turns(db)
    assert t1.finish_reason == "tool_calls" and t2.finish_reason == "stop"
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    titles = [t for t in read_turns(db, with_raw=True) if any(p in (t.request or "") for p in TITLE_PROMPTS)]
    # 2.1.197 names the session even with the recipe's CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC;
    # 2.1.33x only without it.
    assert titles or not nonessential
    assert all(t.tag == "title" for t in titles), [(t.tag, (t.request or "")[:300]) for t in titles]

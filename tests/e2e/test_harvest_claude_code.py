"""The real Claude Code binary, unmodified, harvested through `polar-mitm run --harvest`.

A local HTTPS server with a self-signed certificate poses as api.anthropic.com (mapped with
`--upstream … --upstream-insecure`); Claude Code talks to it with its own API key through the
proxy, and the session must come out as SFT data without that key ever touching the disk.
"""

import glob
import json
import subprocess
from pathlib import Path

import pytest

from tests.support.harness import POLAR, harness_env, polar_run, require_binary

pytestmark = pytest.mark.e2e

KEY = "sk-ant-api03-e2e-HARVEST-9f8e7d6c5b4a39281706"


def db_files(db: Path) -> dict[str, bytes]:
    return {f: Path(f).read_bytes() for f in sorted(glob.glob(str(db) + "*"))}


def test_harvest_records_a_real_claude_code_session_without_its_key(tmp_path, fake_provider):
    require_binary("claude")
    work, db = tmp_path / "work", tmp_path / "sft.sqlite"
    work.mkdir()
    env = harness_env(tmp_path / "home")
    env["ANTHROPIC_API_KEY"] = KEY
    r = polar_run(
        [
            "--harvest",
            "--db",
            str(db),
            "--session",
            "cc-harvest",
            "--upstream",
            f"api.anthropic.com={fake_provider.url}",
            "--upstream-insecure",
        ],
        ["claude", "-p", "Create out.txt containing hi", "--allowedTools", "Bash"],
        cwd=work,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert fake_provider.ANSWER in r.stdout  # the harness printed the upstream's answer
    assert (work / "out.txt").read_text() == "hi\n"  # ...after running the upstream's tool call
    assert "session cc-harvest" in r.stderr and "turns harvested" in r.stderr

    # The upstream received every model call with the harness's own key.
    calls = [q for q in fake_provider.requests if q["path"].split("?")[0] == "/v1/messages"]
    assert len(calls) >= 2
    assert all({k.lower(): v for k, v in q["headers"].items()}.get("x-api-key") == KEY for q in calls)

    out = tmp_path / "sft.jsonl"
    e = subprocess.run(
        [*POLAR, "export", "--db", str(db), "--format", "sft-jsonl", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert e.returncode == 0, e.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    finals = [x for x in lines if fake_provider.ANSWER in x["messages"][-1]["content"]]
    assert len(finals) == 1, [x["messages"][-1] for x in lines]
    conv = finals[0]
    roles = [m["role"] for m in conv["messages"]]
    assert roles[-3:] == ["assistant", "tool", "assistant"] and "user" in roles
    bash = conv["messages"][-3]["tool_calls"][0]
    assert (
        bash["function"]["name"] == "Bash"
        and "out.txt" in json.loads(bash["function"]["arguments"])["command"]
    )
    assert any(t["function"]["name"] == "Bash" for t in conv["tools"])
    assert conv["metadata"]["source"] == "harvest" and len(conv["metadata"]["turn_ids"]) == 2

    # Not in the database, its write-ahead log or shared memory — before or after the export.
    files = db_files(db)
    assert str(db) in files and b"[redacted]" in b"".join(files.values())
    for name, data in files.items():
        assert KEY.encode() not in data, name

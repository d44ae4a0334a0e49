"""No credential from a harness's command line reaches the store (`sessions.command`)."""

import json
import sqlite3

from hypothesis import given
from hypothesis import strategies as st

from polar_mitm import redact
from polar_mitm.store.writer import Store

KEYS = [
    "sk-ant-api03-abcdefghijklmnopqrstuvwxyz",
    "sk-proj-0123456789abcdef",
    "AIzaSyA1234567890123456789012",
    "ghp_abcdefghijklmnopqrstuvwx",
    "hf_abcdefghijklmnopqrstuvwx",
    "xai-abcdefghijklmnopqrstuvwx",
]


def test_flags_headers_assignments_urls_and_key_shapes_are_redacted():
    cmd = [
        "cline", "-k", "plain-secret-1", "--api-key", "plain-secret-2", "--auth-token=plain-secret-3",
        "curl", "-H", "x-api-key: plain-secret-4", "--header", "Authorization: Bearer plain-secret-5",
        "https://h/v1?key=plain-secret-6", "env", "OPENAI_API_KEY=plain-secret-7",
        "-p", f"fix it, the key is {KEYS[0]}",
    ]  # fmt: skip
    out = redact.argv(cmd, secret_flags=["-k"])
    text = json.dumps(out)
    for i in range(1, 8):
        assert f"plain-secret-{i}" not in text
    assert KEYS[0] not in text
    assert out[:3] == ["cline", "-k", redact.REDACTED] and out[-1] == f"fix it, the key is {redact.REDACTED}"


def test_ordinary_arguments_are_kept():
    cmd = ["claude", "-p", "fix the bug", "--max-tokens", "100", "--author", "me", "--output-format", "json"]
    assert redact.argv(cmd) == cmd


words = st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=12)


@given(
    args=st.lists(words, max_size=8),
    key=st.sampled_from(KEYS),
    at=st.integers(0, 8),
    glue=st.sampled_from(["{}", "--x={}", "see {} here", "X_TOKEN={}"]),
)
def test_a_key_anywhere_never_survives_and_plain_words_do(args, key, at, glue):
    assert redact.argv(args) == args
    cmd = list(args)
    cmd.insert(min(at, len(cmd)), glue.format(key))
    assert key not in json.dumps(redact.argv(cmd))


async def test_the_store_keeps_the_command_redacted(tmp_path):
    db = tmp_path / "s.sqlite"
    store = await Store.open(db)
    try:
        await store.ensure_session(
            "s1", command=["aider", "--api-key", "openai=sk-proj-0123456789abcdef", "x"]
        )
    finally:
        await store.close()
    [(command,)] = sqlite3.connect(db).execute("SELECT command FROM sessions").fetchall()
    assert "sk-proj" not in command and json.loads(command)[:2] == ["aider", "--api-key"]

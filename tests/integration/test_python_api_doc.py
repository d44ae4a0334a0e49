"""docs/python-api.md's rollout example runs as written, against the fake engine: only the
backend, the tokenizer, the tasks (one plain task file) and the runtime are this machine's (and the harness a shell line
that makes a model call, as the other rollout tests' harnesses are)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from polar_mitm.tasks.model import EvaluatorSpec, Task
from tests.support.harness import FakeBackend
from tests.support.helpers import MODEL_CALL

DOC = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"


def example() -> str:
    text = DOC.read_text()
    section = text[text.index("## A rollout from Python") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_documented_rollout_runs_against_the_fake_engine(tmp_path, qwen_tokenizer_dir, certs_dir):
    code = example()
    assert len(code.strip().splitlines()) < 15
    task = Task(id="hello", instruction="say hi", evaluator=EvaluatorSpec(kind="command", command="true"))
    (tmp_path / "hello.json").write_text(task.model_dump_json())
    backend = FakeBackend(qwen_tokenizer_dir)
    try:
        harness_cmd = ["sh", "-c", MODEL_CALL, "harness", "{instruction}"]
        for old, new in (
            ('"http://127.0.0.1:30000"', repr(backend.url)),
            ('"./qwen3-tok"', repr(str(qwen_tokenizer_dir))),
            ('"tasks/"', '"hello.json"'),  # a plain task file: its command evaluator needs no container
            (
                'runtime="docker"',
                f'runtime="local", harness_cmd={harness_cmd!r}, certs_dir={str(certs_dir)!r}',
            ),
            ("RolloutOptions(samples=8)", "RolloutOptions(samples=2)"),
        ):
            assert old in code, old
            code = code.replace(old, new)
        r = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
    finally:
        backend.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[:2] == ["hello 0 completed 1.0", "hello 1 completed 1.0"]
    rows = pq.read_table(tmp_path / "groups.parquet").to_pylist()
    assert len(rows) == 2 and {row["reward"] for row in rows} == {1.0}

#!/usr/bin/env bash
# The main job on a fresh machine: install only what it uses (scripts/install.sh --main: the
# package, Claude Code, Docker), start the built-in fake SGLang backend, run the real Claude Code
# CLI through polar-mitm, export the captured session to parquet and print its stats; then roll
# out two tasks in Docker containers and write the scored groups (POLAR_MITM_NO_DOCKER=1: the
# capture only).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "demo: [$((SECONDS / 60))m$((SECONDS % 60))s] $*" >&2; }

say "installing what the main job uses (scripts/install.sh --main; skipped where done)"
bash scripts/install.sh --main

OUT=${OUT:-demo}
PORT=${PORT:-30000}
mkdir -p "$OUT/work"
say "building the Qwen tokenizer offline (cached after the first time)"
TOK=$(.venv/bin/polar-mitm tokenizer build --kind qwen)

say "starting the fake SGLang backend on 127.0.0.1:$PORT (log: $OUT/fake-backend.log)"
.venv/bin/polar-mitm fake-backend --port "$PORT" --tokenizer "$TOK" > "$OUT/fake-backend.log" 2>&1 &
BACKEND=$!
trap 'kill $BACKEND 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.2; done

# 1. The capture: the real Claude Code CLI, unmodified, through the proxy; every turn in SQLite.
DB="$PWD/$OUT/runs.sqlite"
say "1/2 the capture: claude -p through polar-mitm run (db: $DB)"
(cd "$OUT/work" && HOME="$PWD/../home" ../../.venv/bin/polar-mitm run \
    --backend "http://127.0.0.1:$PORT" --tokenizer "$TOK" --tool-parser qwen25 --db "$DB" \
    -- claude -p "Create out.txt containing hi" --allowedTools Bash)
echo "out.txt: $(cat "$OUT/work/out.txt")"

.venv/bin/polar-mitm export --db "$DB" --strategy prefix-merge --format parquet --out "$OUT/traj.parquet"
.venv/bin/polar-mitm stats --db "$DB"
.venv/bin/python -c "import pyarrow.parquet as pq; t = pq.read_table('$OUT/traj.parquet'); print(t.schema); print(t.num_rows, 'trajectory rows')"
say "captured: $OUT/runs.sqlite, $OUT/traj.parquet"

# 2. Rollouts: two Harbor tasks x 2 samples, each sample Claude Code in its own Docker container,
# scored by the task's tests, written as GRPO groups.
if [ "${POLAR_MITM_NO_DOCKER:-}" != 1 ]; then
  say "2/2 the rollout: examples/tasks x 2 samples, Claude Code in Docker"
  .venv/bin/polar-mitm rollout examples/tasks --harness claude-code --runtime docker --samples 2 \
      --backend "http://127.0.0.1:$PORT" --tokenizer "$TOK" --tool-parser qwen25 \
      --db "$OUT/rollouts.sqlite" --out "$OUT/groups.parquet"
  .venv/bin/python - "$OUT/groups.parquet" <<'EOF'
import sys

import pyarrow.parquet as pq

cols = ["task_id", "group_id", "sample_index", "status", "reward", "advantage"]
rows = pq.read_table(sys.argv[1], columns=cols).to_pylist()
print("  ".join(cols))
for r in rows:
    print("  ".join(str(r[c]) for c in cols))
EOF
  say "rolled out: $OUT/rollouts.sqlite, $OUT/groups.parquet"
fi
say "done"

#!/usr/bin/env bash
# The main job on a fresh machine: install, start the built-in fake SGLang backend, run the real
# Claude Code CLI through polar-mitm, export the captured session to parquet, then roll out two
# tasks in Docker containers and write the scored groups.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh

OUT=${OUT:-demo}
PORT=${PORT:-30000}
mkdir -p "$OUT/work"
TOK=$(.venv/bin/polar-mitm tokenizer build --kind qwen)

.venv/bin/polar-mitm fake-backend --port "$PORT" --tokenizer "$TOK" > "$OUT/fake-backend.log" 2>&1 &
BACKEND=$!
trap 'kill $BACKEND 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.2; done

DB="$PWD/$OUT/runs.sqlite"
(cd "$OUT/work" && HOME="$PWD/../home" ../../.venv/bin/polar-mitm run \
    --backend "http://127.0.0.1:$PORT" --tokenizer "$TOK" --tool-parser qwen25 --db "$DB" \
    -- claude -p "Create out.txt containing hi" --allowedTools Bash)
echo "out.txt: $(cat "$OUT/work/out.txt")"

.venv/bin/polar-mitm export --db "$DB" --strategy prefix-merge --format parquet --out "$OUT/traj.parquet"
.venv/bin/polar-mitm stats --db "$DB"
.venv/bin/python -c "import pyarrow.parquet as pq; t = pq.read_table('$OUT/traj.parquet'); print(t.schema); print(t.num_rows, 'trajectory rows')"

# Rollouts: two Harbor tasks x 2 samples, each sample Claude Code in its own Docker container,
# scored by the task's tests, written as GRPO groups.
if [ "${POLAR_MITM_NO_DOCKER:-}" != 1 ]; then
  .venv/bin/polar-mitm rollout examples/tasks --harness claude-code --runtime docker --samples 2 \
      --backend "http://127.0.0.1:$PORT" --tokenizer "$TOK" --tool-parser qwen25 \
      --db "$OUT/rollouts.sqlite" --out "$OUT/groups.parquet"
  .venv/bin/python -c "import pyarrow.parquet as pq; t = pq.read_table('$OUT/groups.parquet'); print(t.select(['task_id', 'group_id', 'sample_index', 'status', 'reward', 'advantage']).to_pandas().to_string())"
fi

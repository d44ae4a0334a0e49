"""The store: one SQLite file (WAL) that every turn, session, rollout and service task is written
to, and that every offline command reads.

Writing: `writer.Store`, the async writer the proxy uses (a turn's prompt stored as a reference
to an earlier turn's sequence plus its own suffix, its request as a delta, `deltas`), the row
model it stores (`turn.Turn`) and the ids' packing (`packing`). Reading: `reader.read_turns`
(references resolved through `sequences`, raw requests through `requests`), and `queries`, where
every other question over turns and sessions is asked. Rollouts (`rollouts.RolloutLog`) and the
rollout service's state (`service`) have their own tables; `connection` opens the file and
`migrations` evolves its schema, one recorded step at a time. docs/data.md describes the schema.
"""

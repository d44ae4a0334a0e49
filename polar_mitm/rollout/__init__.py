"""Rollouts: run tasks N times in sandboxes with an unmodified harness, score every sample, and
hand the trainer groups (`pipeline.Pipeline`, `report`, `progress`; the `rollout` command)."""

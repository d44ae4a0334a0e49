"""Rollouts: run tasks N times in sandboxes with an unmodified harness, score every sample, and
hand the trainer groups (`pipeline.Pipeline`, `verify` and `evaluators` for scoring, `progress`,
`options`; the `rollout` command). The table a rollout prints is `polar_mitm/reconstruct/report.py`."""

"""Thin adapters from the rollout service to trainers (`slime`, `verl`). Each imports its
trainer lazily: with the trainer installed it returns the trainer's own types, without it plain
objects with the same fields (so the adapters are testable, and importable, anywhere)."""

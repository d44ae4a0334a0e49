"""Offline reconstruction: stored turns → training rows (per-request or prefix-merged) → files.

`per_request` and `prefix_merge` are pure functions over `Turn`s; `export` streams a store
through one of them into parquet or JSON lines. Its commands are in `polar_mitm/cli/data.py`.
"""

from polar_mitm.reconstruct.per_request import per_request
from polar_mitm.reconstruct.prefix_merge import SessionMerger, prefix_merge
from polar_mitm.reconstruct.stats import ReconstructStats
from polar_mitm.reconstruct.trajectory import TRAJECTORY_SCHEMA, Trajectory

__all__ = [
    "TRAJECTORY_SCHEMA",
    "ReconstructStats",
    "SessionMerger",
    "Trajectory",
    "per_request",
    "prefix_merge",
]

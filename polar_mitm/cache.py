"""Where polar-mitm keeps what it builds once and reuses: `$POLAR_MITM_CACHE`, else
`~/.cache/polar-mitm` (tokenizers, harness virtualenvs and links, converted Apptainer images,
the viewers' and instances' registries)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("POLAR_MITM_CACHE") or Path.home() / ".cache" / "polar-mitm")

"""Node's built-in fetch through the proxy on Node 18-22 (see node_proxy.cjs beside this file).

`env(base)` gives the variables that load the preload into every Node process a harness starts:
NODE_OPTIONS gains `--require <preload>` (the user's own options kept), and POLAR_MITM_UNDICI
names the undici package the preload takes EnvHttpProxyAgent from. Where no undici is installed
the preload is not added: there is nothing it could do; POLAR_MITM_NODE_PRELOAD=0 leaves it out.
"""

from __future__ import annotations

import shlex
import shutil
from collections.abc import Mapping
from pathlib import Path

from polar_mitm.once import once

PRELOAD = Path(__file__).with_name("node_proxy.cjs")
UNDICI_VERSION = "6.29.1"  # the newest undici that still runs on Node 18 (installed by scripts/install.sh)


@once
def undici_dir() -> Path | None:
    """The globally installed undici package (`npm install -g undici`), found beside node."""
    node = shutil.which("node")
    if node is None:
        return None
    prefix = Path(node).resolve().parent.parent
    for root in (prefix / "lib" / "node_modules", prefix / "node_modules"):
        if (root / "undici" / "package.json").is_file():
            return root / "undici"
    return None


def env(base: Mapping[str, str], *, preload: str | None = None, undici: str | None = None) -> dict[str, str]:
    """NODE_OPTIONS and POLAR_MITM_UNDICI for a harness whose environment is `base`; `preload` and
    `undici` are the paths as the harness sees them (a sandbox's mounts), the host's by default.
    POLAR_MITM_NODE_PRELOAD=0 in `base` turns it off."""
    if base.get("POLAR_MITM_NODE_PRELOAD") == "0":
        return {}
    if undici is None:
        found = undici_dir()
        if found is None:
            return {}
        undici = str(found)
    preload = preload or str(PRELOAD)
    options = base.get("NODE_OPTIONS", "")
    flag = f"--require={shlex.quote(preload)}"
    if flag in options:
        return {"POLAR_MITM_UNDICI": undici}
    return {"NODE_OPTIONS": f"{options} {flag}".strip(), "POLAR_MITM_UNDICI": undici}

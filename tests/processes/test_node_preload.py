"""Node 18-22's built-in fetch ignores HTTPS_PROXY; the preload `run` gives every Node harness
(harness/node_proxy.cjs) sends it through the proxy. Tested with this machine's Node and a fetch
to api.anthropic.com, which the test's own preload resolves to a loopback address where nothing
listens (nothing leaves the machine): without our preload fetch goes there directly and fails;
with it the proxy answers and the turn is recorded."""

import shutil
import sqlite3
import subprocess
import sys

import pytest

from polar_mitm.harness import node_proxy

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or node_proxy.undici_dir() is None,
    reason="needs node and undici (scripts/install.sh installs both)",
)

# The test's stand-in for DNS: every name but loopback's resolves to 127.0.0.2.
LOOPBACK_DNS = """
const dns = require("dns");
const lookup = dns.lookup;
dns.lookup = function (host, options, cb) {
  if (typeof options === "function") { cb = options; options = {}; }
  if (host === "127.0.0.1" || host === "localhost") return lookup.call(this, host, options, cb);
  if (options && options.all) return process.nextTick(cb, null, [{address: "127.0.0.2", family: 4}]);
  return process.nextTick(cb, null, "127.0.0.2", 4);
};
"""

SCRIPT = """
fetch("https://api.anthropic.com/v1/messages", {
  method: "POST",
  headers: {"content-type": "application/json", "x-api-key": "k", "anthropic-version": "2023-06-01"},
  body: JSON.stringify({model: "m", max_tokens: 16, messages: [{role: "user", content: "hi"}]}),
}).then(async (r) => { console.log("status", r.status); process.exit(r.status === 200 ? 0 : 1); },
        (e) => { console.log("fetch failed:", e.cause && e.cause.code); process.exit(2); });
"""


def run_node(tmp_path, certs_dir, backend_url, *, preload: bool):
    script = tmp_path / "fetch.js"
    script.write_text(SCRIPT)
    dns = tmp_path / "loopback-dns.js"
    dns.write_text(LOOPBACK_DNS)
    db = tmp_path / f"r{int(preload)}.sqlite"
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "NODE_OPTIONS": f"--require={dns}",
        "POLAR_MITM_NODE_PRELOAD": "1" if preload else "0",
    }
    p = subprocess.run(
        [sys.executable, "-m", "polar_mitm", "run", "--backend", backend_url, "--certs", str(certs_dir)]
        + ["--db", str(db), "--", "node", str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env={**env, "PYTHONPATH": ":".join(sys.path)},
    )
    turns = sqlite3.connect(db).execute("SELECT COUNT(*) FROM turns").fetchone()[0] if db.exists() else 0
    return p, turns


def test_fetch_goes_through_the_proxy_only_with_the_preload(tmp_path, certs_dir, backend_process):
    bare, turns = run_node(tmp_path, certs_dir, backend_process.url, preload=False)
    assert bare.returncode == 2 and "ECONNREFUSED" in bare.stdout, bare.stdout + bare.stderr
    assert turns == 0
    assert "made no connection through the proxy" in bare.stderr and "HTTPS_PROXY" in bare.stderr
    with_preload, turns = run_node(tmp_path, certs_dir, backend_process.url, preload=True)
    assert "made no connection" not in with_preload.stderr
    assert "experimental" not in with_preload.stderr  # undici's warning is not the harness's output
    assert with_preload.returncode == 0 and "status 200" in with_preload.stdout, (
        with_preload.stdout + with_preload.stderr
    )
    assert turns == 1


def test_the_users_node_options_are_kept():
    env = node_proxy.env({"NODE_OPTIONS": "--max-old-space-size=4096"})
    assert env["NODE_OPTIONS"].startswith("--max-old-space-size=4096 --require=")
    assert node_proxy.env({"NODE_OPTIONS": env["NODE_OPTIONS"]}).get("NODE_OPTIONS") is None  # not twice
    assert node_proxy.env({"POLAR_MITM_NODE_PRELOAD": "0"}) == {}

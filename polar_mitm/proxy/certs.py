"""The CA: generated once, reused; private key readable by its owner only.

Files in the certs directory (mitmproxy's layout, basename "mitmproxy"):
  mitmproxy-ca.pem       key + certificate (mode 0600), what the proxy signs with
  mitmproxy-ca-cert.pem  the CA certificate alone (for NODE_EXTRA_CA_CERTS and friends)
  polar-mitm-bundle.pem  system roots + our CA (for SSL_CERT_FILE / REQUESTS_CA_BUNDLE), so the
                         harness's other HTTPS traffic keeps working
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel

BASENAME = "mitmproxy"
SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
)


class CA(BaseModel):
    dir: Path
    key_and_cert: Path
    cert: Path
    bundle: Path


def default_certs_dir() -> Path:
    """certs/ in a source checkout, else ~/.polar-mitm/certs."""
    env = os.environ.get("POLAR_MITM_CERTS")
    if env:
        return Path(env).expanduser()
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").exists() and (checkout / "certs").is_dir():
        return checkout / "certs"
    return Path.home() / ".polar-mitm" / "certs"


def system_roots() -> bytes:
    for p in SYSTEM_BUNDLES:
        if os.path.exists(p):
            return Path(p).read_bytes()
    try:
        import certifi

        return Path(certifi.where()).read_bytes()
    except ImportError:
        return b""


def ensure_ca(certs_dir: Path | None = None) -> CA:
    from mitmproxy.certs import CertStore

    d = Path(certs_dir or default_certs_dir()).expanduser()
    d.mkdir(parents=True, exist_ok=True)
    key_and_cert = d / f"{BASENAME}-ca.pem"
    if not key_and_cert.exists():
        CertStore.create_store(d, BASENAME, 2048, organization="polar-mitm", cn="polar-mitm CA")
    for secret in (key_and_cert, d / f"{BASENAME}-ca.p12"):
        if secret.exists():
            os.chmod(secret, 0o600)
    cert = d / f"{BASENAME}-ca-cert.pem"
    bundle = d / "polar-mitm-bundle.pem"
    want = system_roots().rstrip(b"\n") + b"\n" + cert.read_bytes()
    if not bundle.exists() or bundle.read_bytes() != want:
        tmp = bundle.with_suffix(".tmp")
        tmp.write_bytes(want)
        tmp.replace(bundle)
    return CA(dir=d, key_and_cert=key_and_cert, cert=cert, bundle=bundle)

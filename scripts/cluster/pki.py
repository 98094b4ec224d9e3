"""The cluster's credentials (openssl): a CA, the API server's serving certificate, its client certificate for
kubelet, the service-account key pair, one bearer token per component, and a kubeconfig for each."""

from __future__ import annotations

import base64
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from cluster.common import API_PORT, NODE_ADDR, run

# user, groups: one token each in the API server's --token-auth-file.
IDENTITIES = {
    "admin": ("admin", ["system:masters"]),
    "controller-manager": ("system:kube-controller-manager", []),
    "scheduler": ("system:kube-scheduler", []),
    "kube-proxy": ("system:kube-proxy", []),  # bound to system:node-proxier by the bootstrap policy
}


@dataclass(frozen=True)
class Pki:
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    def cert(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    def kubeconfig(self, name: str) -> Path:
        return self.dir / f"{name}.kubeconfig"

    @property
    def tokens(self) -> Path:
        return self.dir / "tokens.csv"


def _sign(pki: Pki, name: str, subject: str, ext: str) -> None:
    key, csr, cert = pki.key(name), pki.dir / f"{name}.csr", pki.cert(name)
    run(["openssl", "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-subj", subject, "-out", csr])
    extfile = pki.dir / f"{name}.ext"
    extfile.write_text(ext)
    run(["openssl", "x509", "-req", "-in", csr, "-CA", pki.ca, "-CAkey", pki.key("ca"), "-CAcreateserial",
         "-days", "30", "-sha256", "-extfile", extfile, "-out", cert])  # fmt: skip
    csr.unlink()
    extfile.unlink()


def make(pki_dir: Path, node_names: list[str], service_ip: str) -> Pki:
    """The credentials; a kubelet identity per node (kubeconfig ``kubelet`` for the first, ``kubelet-NAME``)."""
    pki = Pki(pki_dir)
    pki_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30", "-sha256",
         "-subj", "/CN=nodeplug-cluster-ca", "-keyout", pki.key("ca"), "-out", pki.ca,
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"])  # fmt: skip
    sans = ",".join([
        f"IP:{NODE_ADDR}", f"IP:{service_ip}", "IP:127.0.0.1", "DNS:localhost", "DNS:kubernetes",
        "DNS:kubernetes.default", "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local",
    ])  # fmt: skip
    _sign(pki, "apiserver", "/CN=kube-apiserver", f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\n")
    _sign(pki, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client",
          "extendedKeyUsage=clientAuth\n")  # fmt: skip
    _sign(pki, "front-proxy-client", "/CN=front-proxy-client", "extendedKeyUsage=clientAuth\n")
    run(["openssl", "genrsa", "-out", pki.key("sa"), "2048"])
    run(["openssl", "rsa", "-in", pki.key("sa"), "-pubout", "-out", pki.dir / "sa.pub"])

    identities = dict(IDENTITIES)
    for k, name in enumerate(node_names):
        identities["kubelet" if k == 0 else f"kubelet-{name}"] = (f"system:node:{name}", ["system:nodes"])
    rows = []
    for name, (user, groups) in identities.items():
        token = secrets.token_hex(24)
        rows.append(f'{token},{user},{user},"{",".join(groups)}"')
        write_kubeconfig(pki, name, token)
    pki.tokens.write_text("\n".join(rows) + "\n")
    for f in pki_dir.iterdir():
        f.chmod(0o600)
    return pki


def write_kubeconfig(pki: Pki, name: str, token: str) -> None:
    ca = base64.b64encode(pki.ca.read_bytes()).decode()
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "nodeplug", "cluster": {"server": f"https://{NODE_ADDR}:{API_PORT}",
                                                       "certificate-authority-data": ca}}],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [{"name": "nodeplug", "context": {"cluster": "nodeplug", "user": name}}],
        "current-context": "nodeplug",
    }  # fmt: skip
    pki.kubeconfig(name).write_text(json.dumps(cfg, indent=2) + "\n")

"""The images the upstream end-to-end suites run, built here without a registry (scripts/conformance).

``e2e.test`` names its images by upstream registry (``registry.k8s.io/e2e-test-images/agnhost:2.53``, ...); given a
repository list (:func:`repo_list`, ``--kube-test-repo-list``) mapping every registry to ``localhost/e2e``, it asks
for ``localhost/e2e/NAME:TAG`` instead, with the upstream name and tag. None of those tags is ``latest``, so kubelet
never pulls them: they are imported into the node's containerd with the other images.

- ``agnhost:2.53``: the workload of the network suites. The ``agnhost`` binary of KUBE_ASSETS (the v1.32 tree's
  test image program) on a Debian minbase from this machine's apt mirror, with what the suites exec in it: ``sh``
  and ``bash``, ``curl`` and ``nc`` (the Networking conformance specs probe with ``curl`` and ``nc -u``), ``ip``,
  ``dig``, ``ping``, ``mount``, ``ps``. As upstream's image: ``/agnhost`` as ENTRYPOINT with CMD ``pause``, a
  link ``/agnhost-2``, a world-writable ``/uploads``, and ``/localhost.crt`` + ``/localhost.key`` (a self-signed
  pair for ``porter``'s TLS port).
- ``busybox:1.36.1-1``, ``nginx:1.14-4``, ``jessie-dnsutils:1.7``: Debian's busybox-static (1.35) and its applets.
  The storage suites only run ``sh`` scripts (``dd``, ``md5sum``, ``stat``, ``mount``, ...) in all three.
- ``pause:3.10``: the same root waiting for SIGTERM.

Cached by content under CACHE/images like the cluster's other images: agnhost by its recipe, the apt sources and the
binary's digest; the busybox ones by busybox's digest.
"""

from __future__ import annotations

import os
from pathlib import Path

from cluster import images, kubecache
from cluster.common import KUBE_ASSETS, log, run

REGISTRY = "localhost/e2e"
# Every registry key of the e2e image manifest (test/utils/image's RegistryList), all to REGISTRY but the one the
# suites use for "an image that cannot be pulled".
REGISTRY_KEYS = [
    "gcAuthenticatedRegistry", "promoterE2eRegistry", "buildImageRegistry", "gcEtcdRegistry", "gcRegistry",
    "sigStorageRegistry", "privateRegistry", "dockerLibraryRegistry", "cloudProviderGcpRegistry",
]  # fmt: skip
AGNHOST = f"{REGISTRY}/agnhost:2.53"
BUSYBOX_ROOTED = [f"{REGISTRY}/busybox:1.36.1-1", f"{REGISTRY}/nginx:1.14-4", f"{REGISTRY}/jessie-dnsutils:1.7"]
PAUSE = f"{REGISTRY}/pause:3.10"
PACKAGES = ["bash", "curl", "netcat-openbsd", "iproute2", "bind9-dnsutils", "iputils-ping", "procps", "mount",
            "ca-certificates"]  # fmt: skip


def repo_list() -> str:
    """The ``--kube-test-repo-list`` file's content: each registry prefix -> REGISTRY; name and tag stay."""
    rows = [f"{k}: {REGISTRY}" for k in REGISTRY_KEYS] + ["invalidRegistry: invalid.registry.k8s.io/invalid"]
    return "\n".join(rows) + "\n"


def available() -> bool:
    return (KUBE_ASSETS / "agnhost.xz").is_file()


def agnhost_image() -> Path:
    agnhost = kubecache.unpack(KUBE_ASSETS / "agnhost.xz", images.CACHE)
    suite, sources = images.apt_sources()
    hooks = [
        'chmod 0755 "$1"/agnhost && ln -s agnhost "$1"/agnhost-2 && mkdir -m 0777 "$1"/uploads',
        'openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj /CN=localhost -keyout "$1"/localhost.key '
        '-out "$1"/localhost.crt 2>/dev/null',
        'rm -rf "$1"/var/cache/apt/*.bin "$1"/var/lib/apt/lists/*',
    ]
    args = ["--variant=minbase", f"--include={','.join(PACKAGES)}",
            "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*",
            *[f"--customize-hook={h}" for h in hooks]]  # fmt: skip
    # The key: the recipe, the binary's content (not where the cache unpacked it), the mirror.
    k = images.key(*args, kubecache.digest(KUBE_ASSETS / "agnhost.xz"), suite, *[f.read_text() for f in sources])
    upload = f"--customize-hook=upload {agnhost} /agnhost"  # before the hooks above, which expect it there
    archive = images.IMAGES / f"agnhost-2.53-{k}.tar"
    if archive.exists():
        return archive
    images.IMAGES.mkdir(parents=True, exist_ok=True)
    tar = images.IMAGES / f".{os.getpid()}-agnhost-rootfs.tar"  # mmdebstrap picks its output format by the suffix
    log(f"building {AGNHOST} (Debian {suite} minbase with sh, curl, nc; agnhost from KUBE_ASSETS) ...")
    try:
        run(["mmdebstrap", "--quiet", upload, *args, suite, tar, *sources], timeout=900)
        changes = ['ENTRYPOINT ["/agnhost"]', 'CMD ["pause"]']
        images.podman("import", *[a for c in changes for a in ("--change", c)], tar, AGNHOST)
    finally:
        tar.unlink(missing_ok=True)
    return images.save(AGNHOST, archive)


def busybox_rooted() -> list[Path]:
    out = [images.busybox_image(name, ["ENV PATH=/bin", 'CMD ["sh"]'], "e2e-v1") for name in BUSYBOX_ROOTED]
    return [*out, images.busybox_image(PAUSE, ["ENV PATH=/bin", f"ENTRYPOINT {images.WAIT_FOR_SIGTERM}"], "e2e-v1")]


def all_images() -> list[Path]:
    """The suites' images as archives for ``ctr images import``; none where KUBE_ASSETS has no agnhost."""
    if not available():
        log(f"{KUBE_ASSETS / 'agnhost.xz'}: absent; the e2e suites' images are not built")
        return []
    return [agnhost_image(), *busybox_rooted()]

"""The cluster's images, built without a registry and saved as archives for ``ctr images import``.

- a Debian base with Python (mmdebstrap from the machine's apt mirror, ``podman import``): what python:3.11-slim is
  to daemonset/Dockerfile (``python``/``pip`` on PATH, pip installs system-wide);
- nodeplug: daemonset/Dockerfile on that base (build argument PYTHON_IMAGE), with the wheels it needs built on the
  host and handed in as the ``wheels`` build context (PyPI over HTTPS is not reachable inside containers here);
- the CSI sidecars and snapshot-controller from KUBE_ASSETS, each its static binary alone in an image;
- busybox (busybox-static from Debian) as the workload image, and a pause image for pod sandboxes.

Everything expensive is cached under CACHE keyed by its inputs (the base by the mmdebstrap recipe and apt sources,
the wheels by pyproject.toml and the PyInstaller pin, binary images by the binary's digest); podman's own layer
cache covers the nodeplug image. A clean cache builds everything from scratch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tarfile
import tempfile
import tomllib
from pathlib import Path

from cluster import assets, kubecache
from cluster.common import CACHE, IMAGE_PREFIX, REPO, ClusterError, log, run

PODMAN = CACHE / "podman"
IMAGES = CACHE / "images"
WHEELS = CACHE / "wheels"
DOCKERFILE = REPO / "daemonset" / "Dockerfile"
VENV_PY = REPO / ".venv" / "bin" / "python"

NODEPLUG = f"{IMAGE_PREFIX}/nodeplug:1"
BUSYBOX = f"{IMAGE_PREFIX}/busybox:1"
PAUSE = f"{IMAGE_PREFIX}/pause:1"
SIDECARS = {
    b: f"{IMAGE_PREFIX}/{b}:1" for b in ("csi-provisioner", "csi-resizer", "csi-snapshotter", "snapshot-controller")
}
# What python:3.11-slim gives the Dockerfile: python and pip on PATH, and the shared libpython PyInstaller needs
# (libpython3-dev brings the release's libpython3.X).
BASE_PACKAGES = ["python3", "python3-pip", "python3-venv", "python-is-python3", "libpython3-dev", "ca-certificates"]


def podman_env() -> dict[str, str]:
    """podman with its storage and configuration in the cache (never the machine's own)."""
    PODMAN.mkdir(parents=True, exist_ok=True)
    (PODMAN / "storage.conf").write_text(
        f'[storage]\ndriver = "overlay"\ngraphroot = "{PODMAN}/graph"\nrunroot = "{PODMAN}/run"\n'
    )
    (PODMAN / "containers.conf").write_text(
        '[containers]\ndefault_ulimits = ["nofile=1024:20000", "nproc=1024:2048"]\n'
        '[engine]\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\nruntime = "runc"\n'
        f'tmp_dir = "{PODMAN}/tmp"\n'
    )
    return {
        **os.environ,
        "CONTAINERS_STORAGE_CONF": str(PODMAN / "storage.conf"),
        "CONTAINERS_CONF": str(PODMAN / "containers.conf"),
        "TMPDIR": str(PODMAN / "tmp"),
    }


def podman(*args: str | Path, timeout: float = 900) -> str:
    (PODMAN / "tmp").mkdir(parents=True, exist_ok=True)
    return run(["podman", *args], timeout=timeout, env=podman_env())


def has_image(name: str) -> bool:
    try:
        podman("image", "exists", name, timeout=60)
    except ClusterError:
        return False
    return True


def key(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:16]


def save(name: str, archive: Path) -> Path:
    """``podman save`` ``name`` to ``archive`` (a docker archive: ctr names the image from its RepoTags)."""
    if not archive.exists():
        archive.parent.mkdir(parents=True, exist_ok=True)
        tmp = archive.with_name(f".{archive.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        podman("save", "--format", "docker-archive", "-o", tmp, name)
        os.replace(tmp, archive)
    return archive


# ---------------------------------------------------------------- the Debian base and the wheels


def apt_sources() -> tuple[str, list[Path]]:
    """This machine's Debian release and its apt source files for it (other vendors' repositories left out)."""
    codename = ""
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            codename = line.split("=", 1)[1].strip('"')
    found = []
    candidates = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for f in candidates:
        if f.suffix not in (".list", ".sources") or not f.is_file():
            continue
        words = f.read_text().split()
        if any(w == codename or w.startswith(f"{codename}-") for w in words):
            found.append(f)
    if not codename or not found:
        raise ClusterError("no apt source for this machine's Debian release in /etc/apt (mmdebstrap needs a mirror)")
    return codename, found


def base_image() -> str:
    """The Debian base with Python, named by a key over its recipe and the apt sources."""
    suite, sources = apt_sources()
    hooks = ['rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED', 'rm -rf "$1"/var/cache/apt/*.bin']
    args = ["--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
            "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*",
            *[f"--customize-hook={h}" for h in hooks]]  # fmt: skip
    k = key(*args, suite, *[f.read_text() for f in sources])
    name = f"localhost/nodeplug-build/debian-python:{k}"
    if has_image(name):
        return name
    tar = IMAGES / f"debian-python-{k}.tar"
    if not tar.exists():
        log(f"building the Debian base image with mmdebstrap ({suite}) ...")
        IMAGES.mkdir(parents=True, exist_ok=True)
        tmp = tar.with_name(f".{os.getpid()}-{tar.name}")  # mmdebstrap picks its output format by the suffix
        sources_args: list[str | Path] = list(sources)
        run(["mmdebstrap", "--quiet", *args, suite, tmp, *sources_args], timeout=900)
        os.replace(tmp, tar)
    podman("import", "--change", "ENV LANG=C.UTF-8", "--change", 'CMD ["python3"]', tar, name)
    return name


def pyinstaller_pin() -> str:
    m = re.search(r'"(pyinstaller==[\w.]+)"', DOCKERFILE.read_text())
    if not m:
        raise ClusterError(f"{DOCKERFILE}: no pinned pyinstaller==VERSION found")
    return m.group(1)


def wheels() -> Path:
    """Wheels of nodeplug's dependencies, its build backend and PyInstaller, built with the host's pip."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    reqs = [*project["build-system"]["requires"], *project["project"]["dependencies"], pyinstaller_pin()]
    out = WHEELS / key(*reqs)
    if (out / "DONE").exists():
        return out
    if not VENV_PY.exists():
        raise ClusterError(f"{VENV_PY}: missing (run scripts/setup)")
    log("building wheels on the host ...")
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=WHEELS.mkdir(parents=True, exist_ok=True) or WHEELS))
    run([VENV_PY, "-m", "pip", "wheel", "--quiet", "--wheel-dir", tmp, *reqs], timeout=900)
    (tmp / "DONE").write_text("\n".join(reqs) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def nodeplug_image() -> Path:
    """daemonset/Dockerfile built on the Debian base, saved as an archive named by the image's ID."""
    base = base_image()
    wheelhouse = wheels()
    log("building the nodeplug image (daemonset/Dockerfile) ...")
    podman(
        "build", "--network", "host", "--layers",
        "-f", DOCKERFILE, "--ignorefile", DOCKERFILE.with_name("Dockerfile.dockerignore"),
        "--build-arg", f"PYTHON_IMAGE={base}", "--build-arg", "PIP_NO_INDEX=1",
        "--build-context", f"wheels={wheelhouse}",
        "-t", NODEPLUG, REPO, timeout=1800,
    )  # fmt: skip
    image_id = podman("image", "inspect", "--format", "{{.Id}}", NODEPLUG).strip()
    return save(NODEPLUG, IMAGES / f"nodeplug-{image_id[:16]}.tar")


# ---------------------------------------------------------------- images of one binary or a busybox root


def rootfs_image(name: str, files: dict[str, Path | str], changes: list[str], k: str) -> Path:
    """An image whose root holds ``files`` (path in image -> host file, or -> symlink target when a str)."""
    archive = IMAGES / f"{name.rsplit('/', 1)[-1].replace(':', '-')}-{k}.tar"
    if archive.exists():
        return archive
    IMAGES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=IMAGES) as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        with tarfile.open(rootfs, "w") as t:
            for d in ("tmp", "etc", "bin"):
                info = tarfile.TarInfo(d)
                info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
                t.addfile(info)
            for dest, src in sorted(files.items()):
                if isinstance(src, str):
                    info = tarfile.TarInfo(dest)
                    info.type, info.linkname = tarfile.SYMTYPE, src
                    t.addfile(info)
                else:
                    t.add(src, arcname=dest)
        podman("import", *[a for c in changes for a in ("--change", c)], rootfs, name)
        return save(name, archive)


def busybox_files() -> dict[str, Path | str]:
    bb = Path("/bin/busybox")
    if not bb.exists():
        raise ClusterError("/bin/busybox: missing (Debian package busybox-static; scripts/setup installs it)")
    applets = run([bb, "--list"]).split()
    files: dict[str, Path | str] = {f"bin/{a}": "busybox" for a in applets if a != "busybox"}
    files["bin/busybox"] = bb
    return files


# The sandbox holds the pod's namespaces until it is stopped: PID 1 waits and exits on SIGTERM.
WAIT_FOR_SIGTERM = json.dumps(["/bin/sh", "-c", 'trap "exit 0" TERM INT; sleep 2147483647 & wait'])


def busybox_image(name: str, changes: list[str], tag: str) -> Path:
    """An image of busybox and its applet links, with root and nobody in /etc/passwd; cached by busybox's digest and
    ``tag`` (the caller's recipe)."""
    files = busybox_files()
    with tempfile.TemporaryDirectory(prefix="npc-etc-") as tmp:
        etc = Path(tmp)
        (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
        (etc / "group").write_text("root:x:0:\nnobody:x:65534:\n")
        files |= {"etc/passwd": etc / "passwd", "etc/group": etc / "group"}
        return rootfs_image(name, files, changes, key(kubecache.digest(Path("/bin/busybox")), tag))


def busybox_images() -> list[Path]:
    return [
        busybox_image(BUSYBOX, ['CMD ["sh"]'], "v1"),
        busybox_image(PAUSE, [f"ENTRYPOINT {WAIT_FOR_SIGTERM}"], "v1"),
    ]


def sidecar_images() -> list[Path]:
    out = []
    for binary, name in SIDECARS.items():
        path = assets.binary(binary)
        entry = json.dumps([f"/{binary}"])
        out.append(rootfs_image(name, {binary: path}, [f"ENTRYPOINT {entry}"], key(path.parent.name)))
    return out


def all_images() -> list[Path]:
    """Every image the cluster runs, as archives for ``ctr images import``."""
    return [nodeplug_image(), *sidecar_images(), *busybox_images()]

"""The one cache of the Kubernetes binaries (scripts/cluster/kubecache.py, used by cluster-up and the tests): keyed
by content, and safe when several processes unpack at once: a binary is there whole or not at all."""

from __future__ import annotations

import lzma
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from support.kubeassets import kubecache

KUBECACHE = Path(kubecache.__file__)  # type: ignore[attr-defined]


def packed(d: Path, name: str, payload: bytes) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.xz"
    path.write_bytes(lzma.compress(payload))
    return path


def leftovers(cache: Path) -> list[str]:
    return [p.name for p in cache.rglob(".*")]


def test_unpacked_once_per_content_and_executable(tmp_path: Path) -> None:
    src = packed(tmp_path / "assets", "kubectl", b"\x7fELF one" * 1000)
    out = kubecache.unpack(src, tmp_path / "cache")  # type: ignore[attr-defined]
    assert out.name == "kubectl" and out.read_bytes() == b"\x7fELF one" * 1000
    assert os.access(out, os.X_OK) and out.stat().st_mode & 0o777 == 0o755
    mtime = out.stat().st_mtime_ns
    assert kubecache.unpack(src, tmp_path / "cache") == out and out.stat().st_mtime_ns == mtime  # type: ignore[attr-defined]
    changed = packed(tmp_path / "assets2", "kubectl", b"\x7fELF two" * 1000)
    again = kubecache.unpack(changed, tmp_path / "cache")  # type: ignore[attr-defined]
    assert again != out and again.read_bytes() == b"\x7fELF two" * 1000 and out.exists()
    assert leftovers(tmp_path / "cache") == []


def test_processes_unpacking_at_once_get_one_whole_binary(tmp_path: Path) -> None:
    payload = os.urandom(1 << 20) * 8  # 8 MiB: long enough for the unpackers to overlap
    src = packed(tmp_path / "assets", "etcd", payload)
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('kc', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "print(m.unpack(__import__('pathlib').Path(sys.argv[2]), __import__('pathlib').Path(sys.argv[3])))\n"
    )
    argv = [sys.executable, "-c", code, str(KUBECACHE), str(src), str(tmp_path / "cache")]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outs = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    (out,) = outs
    assert Path(out).read_bytes() == payload and leftovers(tmp_path / "cache") == []


def test_a_binary_being_unpacked_is_absent_until_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = packed(tmp_path / "assets", "kubelet", b"x" * 4096)
    cache = tmp_path / "cache"
    halfway, go_on = threading.Event(), threading.Event()
    real = shutil.copyfileobj

    def slow_copy(fsrc: Any, fdst: Any, length: int = 0) -> None:
        fdst.write(fsrc.read(100))
        fdst.flush()
        halfway.set()
        go_on.wait(10)
        real(fsrc, fdst)

    monkeypatch.setattr(shutil, "copyfileobj", slow_copy)
    result: list[Path] = []
    t = threading.Thread(target=lambda: result.append(kubecache.unpack(src, cache)))  # type: ignore[attr-defined]
    t.start()
    assert halfway.wait(10)
    (bin_dir,) = (cache / "bin").iterdir()
    assert not (bin_dir / "kubelet").exists() and [p.stat().st_size for p in bin_dir.iterdir()] == [100]
    go_on.set()
    t.join(10)
    assert result[0].read_bytes() == b"x" * 4096 and leftovers(cache) == []


def test_a_broken_archive_leaves_nothing(tmp_path: Path) -> None:
    src = tmp_path / "crictl.xz"
    src.write_bytes(lzma.compress(os.urandom(100000))[:2000])  # cut short
    with pytest.raises((EOFError, lzma.LZMAError)):
        kubecache.unpack(src, tmp_path / "cache")  # type: ignore[attr-defined]
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []

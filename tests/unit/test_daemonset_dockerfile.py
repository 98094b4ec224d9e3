"""daemonset/Dockerfile, read the way docker reads it (no engine here to build it).

Every path it copies from the build context exists in the repository (and the context's ignore file lets it
through), the builder makes the CNI bundle where the final stage copies it from, the final stage puts it where
``nodeplug install-cni`` looks by default, installs the node tools the plugins run, and its command is one the CLI
accepts.
"""

from __future__ import annotations

import fnmatch
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nodeplug import cli, installcni

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "daemonset" / "Dockerfile"
IGNORE = REPO / "daemonset" / "Dockerfile.dockerignore"
# Debian packages of the tools the plugins run: mkfs.ext4/resize2fs, mkfs.xfs/xfs_growfs, btrfs, losetup/mount,
# ip, nft.
NODE_PACKAGES = {"btrfs-progs", "e2fsprogs", "xfsprogs", "util-linux", "mount", "iproute2", "nftables"}


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(ARGs before the first FROM, stages); line continuations joined, comments dropped."""
    lines: list[str] = []
    cur = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not cur and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        lines.append(cur + line)
        cur = ""
    assert not cur, "the Dockerfile ends inside a continued line"
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "ARG" and not stages:
            k, _, v = rest.partition("=")
            args[k] = v
        elif op == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            assert len(words) in (1, 3), f"FROM {rest}"
            stages.append(Stage(words[0], name))
        else:
            assert stages, f"{op} before FROM"
            stages[-1].instructions.append((op, rest))
    return args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], list[Stage]]:
    return parse(DOCKERFILE.read_text())


def _ignored(rel: str, patterns: list[str]) -> bool:
    """BuildKit .dockerignore semantics for the patterns used here: last match wins, ``!`` re-includes."""
    ignored = False
    for p in patterns:
        neg = p.startswith("!")
        pat = p[1:] if neg else p
        pat = pat.rstrip("/")
        hit = fnmatch.fnmatch(rel, pat) or rel.startswith(pat + "/")
        if pat.startswith("**/"):
            hit = hit or fnmatch.fnmatch(Path(rel).name, pat[3:]) or f"/{pat[3:]}/" in f"/{rel}/"
        if hit:
            ignored = not neg
    return ignored


def test_two_stages_on_a_slim_python(dockerfile: tuple[dict[str, str], list[Stage]]) -> None:
    args, stages = dockerfile
    assert len(stages) == 2 and stages[0].name == "builder" and stages[1].name is None
    for s in stages:
        assert s.base == "${PYTHON_IMAGE}"
    assert args["PYTHON_IMAGE"].startswith("python:3.11-slim")


def test_every_path_copied_from_the_context_exists_and_is_not_ignored(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    patterns = [ln.strip() for ln in IGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    copied = 0
    for stage in dockerfile[1]:
        for op, rest in stage.instructions:
            assert op != "ADD", "use COPY"
            if op != "COPY" or rest.startswith("--from="):
                continue
            *sources, _dest = shlex.split(rest)
            for src in sources:
                path = REPO / src
                assert path.exists(), f"COPY {src}: not in the repository"
                files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
                kept = [p for p in files if not _ignored(str(p.relative_to(REPO)), patterns)]
                assert kept, f"COPY {src}: everything is excluded by {IGNORE.name}"
                copied += 1
    assert copied >= 6


def test_the_bundle_goes_where_install_cni_looks(dockerfile: tuple[dict[str, str], list[Stage]]) -> None:
    builder, final = dockerfile[1]
    runs = " ".join(rest for op, rest in builder.instructions if op == "RUN")
    assert "scripts/build-cni-bundle --out /out/cni-bundle" in runs
    assert "CNI_COMMAND=VERSION /out/cni-bundle/nodeplug" in runs, "the builder smoke-tests the bundle"
    copies = [rest for op, rest in final.instructions if op == "COPY"]
    assert f"--from=builder /out/cni-bundle {installcni.DEFAULT_BUNDLE}" in copies
    env = " ".join(rest for op, rest in final.instructions if op == "ENV")
    assert f"NODEPLUG_CNI_BUNDLE={installcni.DEFAULT_BUNDLE}" in env


def test_the_final_stage_installs_the_wheel_and_the_node_tools(dockerfile: tuple[dict[str, str], list[Stage]]) -> None:
    final = dockerfile[1][1]
    runs = [rest for op, rest in final.instructions if op == "RUN"]
    apt = next(r for r in runs if "apt-get install" in r)
    words = set(apt.split())
    assert words >= NODE_PACKAGES, NODE_PACKAGES - words
    assert "--no-install-recommends" in words and "rm -rf /var/lib/apt/lists/*" in apt
    assert any("pip install" in r and "--no-index" in r and "nodeplug" in r for r in runs)
    # No compiler or PyInstaller in the image that runs on every node.
    assert not any("gcc" in r or "pyinstaller" in r for r in runs)


def test_the_command_exists_in_the_cli(dockerfile: tuple[dict[str, str], list[Stage]]) -> None:
    final = dockerfile[1][1]
    cmd = [rest for op, rest in final.instructions if op in ("CMD", "ENTRYPOINT")]
    assert len(cmd) == 1
    argv = json.loads(cmd[0])
    assert argv[0] == "nodeplug"
    args = cli.build_parser().parse_args(argv[1:])
    assert args.command == "agent" and str(args.config) == "/etc/nodeplug/agent.yaml"


def test_the_build_context_keeps_the_sources_and_nothing_else() -> None:
    patterns = [ln.strip() for ln in IGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert not _ignored("nodeplug/cli.py", patterns)
    assert not _ignored("cni/launcher/launcher.c", patterns)
    assert _ignored(".venv/bin/python", patterns)
    assert _ignored("tests/conftest.py", patterns)
    assert _ignored("nodeplug/__pycache__/cli.cpython-311.pyc", patterns)


def test_the_parser_joins_continued_lines() -> None:
    _, stages = parse('FROM a AS builder\n# c\nRUN x \\\n && y\nFROM b\nCMD ["z"]\n')
    assert [s.name for s in stages] == ["builder", None]
    assert stages[0].instructions == [("RUN", "x  && y")]

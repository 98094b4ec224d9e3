"""The entry point in a fresh interpreter, as a runtime execs it: nothing imported beforehand by the test runner.

(pytest itself imports json, which hides a class of start-up bugs from in-process tests: the lean JSON reader in
cni/thick.py relies on json.decoder for its error reporting.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {"CNI_CONTAINERID": "c1", "CNI_NETNS": "/run/netns/none", "CNI_IFNAME": "eth0", "CNI_PATH": "/opt/cni/bin",
       "NODEPLUG_CNI_STANDALONE": "0", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}  # fmt: skip


def entry(command: str, stdin: bytes) -> tuple[int, dict[str, object]]:
    p = subprocess.run(
        [sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); from cni.entry import main; main()",
         str(REPO)],
        input=stdin, env={**ENV, "CNI_COMMAND": command}, capture_output=True, timeout=60,
    )  # fmt: skip
    assert p.stderr == b"", p.stderr.decode()
    return p.returncode, json.loads(p.stdout)


@pytest.mark.parametrize("command", ["ADD", "DEL", "CHECK"])
@pytest.mark.parametrize("stdin", [b"{not json", b'{"cniVersion": "1.0.0", ', b"[1, 2", b'{"a": tru}'])
def test_malformed_config_is_error_6_not_a_traceback(command: str, stdin: bytes) -> None:
    code, out = entry(command, stdin)
    assert code == 1
    assert out["code"] == 6 and "not valid JSON" in str(out["details"])


def test_version_with_malformed_stdin_still_answers() -> None:
    code, out = entry("VERSION", b"{not json")
    assert code == 0 and out["cniVersion"] == "1.1.0"

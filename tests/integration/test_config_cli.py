"""``nodeplug agent --check-config`` and a bad config at start, through the real command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nodeplug.cli", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_check_config_accepts_a_good_file(tmp_path: Path) -> None:
    f = tmp_path / "ok.yaml"
    f.write_text("log_level: debug\ncsi:\n  enabled: false\n")
    p = run_cli("agent", "--check-config", str(f))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"{f}: ok"


def test_bad_config_stops_the_agent_before_it_creates_anything(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("csi:\n  enabled: maybe\nbogus: 1\n")
    root = tmp_path / "root"
    root.mkdir()
    p = run_cli("agent", "--config", str(f), "--root", str(root))
    assert p.returncode == 2
    assert "csi.enabled: input should be a valid boolean" in p.stderr
    assert "bogus: unknown key" in p.stderr
    assert list(root.iterdir()) == []
    p = run_cli("agent", "--check-config", str(f))
    assert p.returncode == 2 and "bogus: unknown key" in p.stderr

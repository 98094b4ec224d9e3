"""Running a CNI plugin as a runtime does: ``CNI_*`` in its environment, the network config on stdin, the result (or
the spec's error) as JSON on stdout."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any


def exec_plugin(argv: Sequence[str], conf: Any, env: Mapping[str, str], timeout: float = 60) -> tuple[int, Any, str]:
    """Run ``argv`` (a plugin, or a wrapper such as ``ip netns exec NS plugin``) with exactly ``env`` and ``conf`` on
    stdin: (exit status, its stdout decoded, or None when empty, and its stderr)."""
    p = subprocess.run(
        list(argv), input=json.dumps(conf).encode(), capture_output=True, env=dict(env), timeout=timeout, check=False
    )
    return p.returncode, json.loads(p.stdout) if p.stdout.strip() else None, p.stderr.decode()

"""The launcher's C fast path (daemonset/bundle/fastpath.c) against the Python entry point it stands in for.

The launcher is compiled here into a stand-in bundle whose "frozen entry point" is a small script that notes it
ran and then runs the real Python entry point. So every case shows both what the runtime gets and whether Python
had to start: VERSION and a thick-mode call never start it; anything unusual falls through to it with stdin intact.
The agent is a stand-in speaking cni/thick.py's protocol, so each failure mode can be produced on purpose.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cni import thick, versions

REPO = Path(__file__).resolve().parents[2]
SOURCES = [REPO / "daemonset/bundle/launcher.c", REPO / "daemonset/bundle/fastpath.c"]

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the launcher")


@pytest.fixture(scope="module")
def bundle() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="npfp-", dir="/tmp"))
    (d / "_internal").mkdir()
    subprocess.run(
        ["gcc", "-static", "-Os", "-Wall", "-Wextra", "-Werror", '-DNODEPLUG_LOADER="loader"',
         "-o", str(d / "nodeplug"), *map(str, SOURCES)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    # The launcher execs: loader --library-path DIR --argv0 APP APP ARGS...; this loader notes it ran, then runs
    # the Python entry point with the stdin the launcher handed on.
    loader = d / "_internal" / "loader"
    loader.write_text(
        "#!/bin/sh\n"
        f'echo ran >> "{d}/python-ran"\n'
        "shift 5\n"
        f'exec {sys.executable} -c "from cni.entry import main; main()" "$@"\n'
    )
    loader.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def run(bundle: Path, env: dict[str, str], stdin: bytes) -> tuple[int, bytes, bool]:
    marker = bundle / "python-ran"
    marker.unlink(missing_ok=True)
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO), **env}
    p = subprocess.run([str(bundle / "nodeplug")], input=stdin, env=full, capture_output=True, timeout=60)
    return p.returncode, p.stdout, marker.exists()


def python_entry(env: dict[str, str], stdin: bytes) -> tuple[int, bytes]:
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO), **env}
    p = subprocess.run(
        [sys.executable, "-c", "from cni.entry import main; main()"], input=stdin, env=full, capture_output=True,
        timeout=60,
    )  # fmt: skip
    return p.returncode, p.stdout


@pytest.mark.parametrize(
    "stdin",
    [b"", b"  \n", b'{"cniVersion":"0.4.0"}', b'{"cniVersion":"1.0.0","name":"x"}', b'{"cniVersion":"9.9.9"}',
     b"[1, 2]", b"{not json", b'{"cniVersion": 4}', b'{"cniVersion":"0.3.0","cniVersion":"0.3.1"}',
     b'{"cniVersion":"1\\u002e0.0"}', '{"cniVersion":"1.0.0","n":"\u00e9"}'.encode()],
)  # fmt: skip
def test_version_answers_exactly_as_python_does(bundle: Path, stdin: bytes) -> None:
    code, out, ran = run(bundle, {"CNI_COMMAND": "VERSION"}, stdin)
    assert (code, out) == python_entry({"CNI_COMMAND": "VERSION"}, stdin)
    assert json.loads(out)["supportedVersions"] == list(versions.SUPPORTED)
    # plain ASCII with no escapes to decode is answered without Python
    assert ran == (b"\\u" in stdin or not stdin.isascii())


class StandIn:
    """A thick-mode agent on a unix socket, doing what ``behave`` says with each connection."""

    def __init__(self, path: Path, behave: Callable[[socket.socket, dict[str, object]], None]) -> None:
        self.path = path
        self.requests: list[dict[str, object]] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.behave = behave
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                req = thick.read_frame(conn)
                self.requests.append(req)
                self.behave(conn, req)

    def close(self) -> None:
        self.sock.close()


def answers(code: int, out: str) -> Callable[[socket.socket, dict[str, object]], None]:
    def behave(conn: socket.socket, req: dict[str, object]) -> None:
        conn.sendall(thick.ACK)
        assert conn.recv(1) == thick.GO
        conn.sendall(thick.encode_frame({"exit": code, "stdout": out}))

    return behave


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="npfs-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def conf(sock: Path, **extra: object) -> bytes:
    return json.dumps({"cniVersion": "1.0.0", "name": "n", "type": "nodeplug", "socket": str(sock), **extra}).encode()


ENV = {
    "CNI_COMMAND": "ADD",
    "CNI_CONTAINERID": "c1",
    "CNI_NETNS": "/run/netns/x",
    "CNI_IFNAME": "eth0",
    "CNI_PATH": "/opt/cni/bin",
    "CNI_ARGS": "K8S_POD_NAME=p;IgnoreUnknown=1",
    "UNRELATED": "not forwarded",
}


def test_thick_call_is_forwarded_and_answered_verbatim_without_python(bundle: Path, sockdir: Path) -> None:
    text = 'result with "quotes", a backslash \\, a newline\n, é ☃ and 😀'
    agent = StandIn(sockdir / "cni.sock", answers(0, text))
    try:
        stdin = conf(sockdir / "cni.sock", ipam={"type": "nodeplug", "subnet": "10.1.0.0/24"}, note='a "b"\tc')
        code, out, ran = run(bundle, ENV, stdin)
    finally:
        agent.close()
    assert (code, out.decode(), ran) == (0, text, False)
    (req,) = agent.requests
    env, got_stdin = thick.parse_request(req)
    assert env == {k: v for k, v in ENV.items() if k.startswith("CNI_")}
    assert got_stdin == stdin


def test_agent_exit_status_is_passed_on(bundle: Path, sockdir: Path) -> None:
    err = json.dumps({"cniVersion": "1.0.0", "code": 7, "msg": "invalid network config", "details": "mtu"})
    agent = StandIn(sockdir / "cni.sock", answers(1, err))
    try:
        assert run(bundle, ENV, conf(sockdir / "cni.sock")) == (1, err.encode(), False)
    finally:
        agent.close()


def test_default_socket_and_ipam_socket_are_where_python_looks(bundle: Path, sockdir: Path) -> None:
    agent = StandIn(sockdir / "ipam.sock", answers(0, "{}"))
    try:
        stdin = json.dumps({"cniVersion": "1.0.0", "name": "n", "ipam": {"socket": str(sockdir / "ipam.sock")}})
        assert run(bundle, ENV, stdin.encode()) == (0, b"{}", False)
    finally:
        agent.close()


def test_agent_that_takes_the_request_and_dies_is_error_11(bundle: Path, sockdir: Path) -> None:
    def die(conn: socket.socket, req: dict[str, object]) -> None:
        conn.sendall(thick.ACK)
        conn.recv(1)  # GO: the request is ours now; then the agent is gone

    agent = StandIn(sockdir / "cni.sock", die)
    try:
        code, out, ran = run(bundle, ENV, conf(sockdir / "cni.sock"))
    finally:
        agent.close()
    assert (code, ran) == (1, False)
    err = json.loads(out)
    assert err["code"] == 11 and err["cniVersion"] == "1.0.0" and err["msg"] == "try again later"
    assert err["details"] == f"the agent at {sockdir / 'cni.sock'} failed before answering: connection closed; " + (
        "retry the operation"
    )


@pytest.mark.parametrize(
    ("why", "make_stdin", "env"),
    [
        ("no agent listening", lambda s: conf(s / "absent.sock"), {}),
        ("config is not JSON", lambda s: b'{"cniVersion": "1.0.0", "socket": ', {}),
        ("socket path has an escape", lambda s: conf(s / "cni.sock").replace(b"/cni.sock", b"\\/cni.sock"), {}),
        ("socket is not a string", lambda s: json.dumps({"cniVersion": "1.0.0", "socket": 5}).encode(), {}),
        ("agentTimeout out of range", lambda s: conf(s / "cni.sock", agentTimeout=0), {}),
        ("agentTimeout is a bool", lambda s: conf(s / "cni.sock", agentTimeout=True), {}),
        ("non-ASCII config", lambda s: conf(s / "cni.sock").replace(b'"n"', '"né"'.encode()), {}),
        ("standalone forced", lambda s: conf(s / "cni.sock"), {"NODEPLUG_CNI_STANDALONE": "1"}),
        ("no command", lambda s: conf(s / "cni.sock"), {"CNI_COMMAND": ""}),
    ],
)
def test_anything_unusual_falls_through_to_python_with_stdin_intact(
    bundle: Path, sockdir: Path, why: str, make_stdin: Callable[[Path], bytes], env: dict[str, str]
) -> None:
    agent = StandIn(sockdir / "cni.sock", answers(0, "from the agent"))
    stdin = make_stdin(sockdir)
    # CHECK with no prevResult fails in Python before any netlink work: a cheap, exact answer to compare
    full = {**ENV, "CNI_COMMAND": "CHECK", **env}
    try:
        code, out, ran = run(bundle, full, stdin)
        expected = python_entry(full, stdin)
    finally:
        agent.close()
    assert ran, why
    # the same answer Python alone gives (which for an escaped socket path or a non-ASCII config is the agent's)
    assert (code, out) == expected, why

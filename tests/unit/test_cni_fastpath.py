"""The bundle's C launcher (cni/launcher/) against the Python entry point it stands in for.

The launcher is compiled here into a stand-in bundle whose "frozen entry point" is a small script that notes it ran
and then runs the real Python entry point. So every case shows both what the runtime gets and whether Python had to
start: VERSION and a thick-mode call never start it; anything else goes to it with stdin intact and with what the
launcher already learnt (an agent is never asked twice). The agent is a stand-in speaking cni/thick.py's framing, so
each failure mode can be produced on purpose.
"""

from __future__ import annotations

import itertools
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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cni import thick, versions
from cni.launcher import protocol

from support.unixlistener import UnixListener

REPO = Path(__file__).resolve().parents[2]
SOURCES = [REPO / "cni/launcher/launcher.c", REPO / "cni/launcher/fastpath.c"]

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the launcher")


def compile_launcher(d: Path) -> None:
    (d / "protocol.h").write_text(protocol.header())
    subprocess.run(
        ["gcc", "-static", "-Os", "-Wall", "-Wextra", "-Werror", f"-I{d}", '-DNODEPLUG_LOADER="loader"',
         "-o", str(d / "nodeplug"), *map(str, SOURCES)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def bundle() -> Iterator[Path]:
    """The stand-in bundle, where install-cni puts one: ``<bin>/nodeplug.d/<id>/`` (the socket record beside it)."""
    top = Path(tempfile.mkdtemp(prefix="npfp-", dir="/tmp"))
    d = top / "nodeplug.d" / "b1"
    (d / "_internal").mkdir(parents=True)
    compile_launcher(d)
    # The launcher execs: loader --library-path DIR --argv0 APP APP ARGS...; this loader notes it ran (and with which
    # notes from the launcher), then runs the Python entry point with the stdin the launcher handed on.
    loader = d / "_internal" / "loader"
    loader.write_text(
        "#!/bin/sh\n"
        f'env | grep ^NODEPLUG_CNI_ | sort >> "{d}/python-ran"; echo ran >> "{d}/python-ran"\n'
        "shift 5\n"
        f'exec {sys.executable} -c "from cni.entry import main; main()" "$@"\n'
    )
    loader.chmod(0o755)
    yield d
    shutil.rmtree(top, ignore_errors=True)


def run(bundle: Path, env: dict[str, str], stdin: bytes) -> tuple[int, bytes, str | None]:
    """(exit status, stdout, what the Python entry point was told or None when it did not run)."""
    marker = bundle / "python-ran"
    marker.unlink(missing_ok=True)
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO), **env}
    p = subprocess.run([str(bundle / "nodeplug")], input=stdin, env=full, capture_output=True, timeout=60)
    return p.returncode, p.stdout, marker.read_text() if marker.exists() else None


def python_entry(env: dict[str, str], stdin: bytes) -> tuple[int, bytes]:
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO), **env}
    p = subprocess.run(
        [sys.executable, "-c", "from cni.entry import main; main()"], input=stdin, env=full, capture_output=True,
        timeout=60,
    )  # fmt: skip
    return p.returncode, p.stdout


@pytest.mark.parametrize(
    "stdin",
    [b"", b"  \n", b'{"cniVersion":"0.4.0"}', b'{"cniVersion":"9.9.9"}', b"[1, 2]", b"{not json",
     b'{"cniVersion":"1\\u002e0.0"}', '{"cniVersion":"1.0.0","n":"\u00e9"}'.encode(), b"\0\xff" * 40000],
)  # fmt: skip
def test_version_answers_exactly_as_python_does_without_python(bundle: Path, stdin: bytes) -> None:
    code, out, ran = run(bundle, {"CNI_COMMAND": "VERSION"}, stdin)
    assert (code, out) == python_entry({"CNI_COMMAND": "VERSION"}, stdin)
    assert json.loads(out) == versions.version_info() and ran is None


Behave = Callable[["StandIn", socket.socket, dict[str, str], bytes], None]


class StandIn:
    """A thick-mode agent on a unix socket, doing what ``behave`` says with each connection it accepts."""

    def __init__(self, path: Path, behave: Behave) -> None:
        self.path = path
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.got_go = 0
        self.behave = behave
        self.listener = UnixListener(path, self._serve)

    def _serve(self, conn: socket.socket) -> None:  # one connection at a time, on the listener's thread
        with conn:
            env_size, stdin_size = thick.parse_header(thick.recv_exact(conn, thick.HEADER_SIZE))
            env, stdin = thick.parse_body(thick.recv_exact(conn, env_size + stdin_size), env_size)
            self.requests.append((env, stdin))
            self.behave(self, conn, env, stdin)

    def ack_and_go(self, conn: socket.socket) -> None:
        conn.sendall(thick.ACK)
        assert conn.recv(1) == thick.GO
        self.got_go += 1

    def close(self) -> None:
        self.listener.close()


def answers(code: int, out: bytes) -> Behave:
    def behave(agent: StandIn, conn: socket.socket, env: dict[str, str], stdin: bytes) -> None:
        agent.ack_and_go(conn)
        conn.sendall(thick.encode_reply(code, out))

    return behave


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="npfs-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def agent(sockdir: Path) -> Iterator[Callable[..., StandIn]]:
    made: list[StandIn] = []

    def start(behave: Behave, name: str = "cni.sock") -> StandIn:
        a = StandIn(sockdir / name, behave)
        made.append(a)
        return a

    yield start
    for a in made:
        a.close()


def conf(sock: Path, **extra: object) -> bytes:
    return json.dumps({"cniVersion": "1.0.0", "name": "n", "type": "nodeplug", "socket": str(sock), **extra}).encode()


def ipam_only(sock: Path, data_dir: Path, **extra: object) -> bytes:
    """A config the entry point serves standalone without netlink or root: nodeplug as the reference bridge's IPAM."""
    ipam = {"type": "nodeplug", "ranges": [[{"subnet": "10.61.0.0/24"}]], "dataDir": str(data_dir)}
    return json.dumps(
        {"cniVersion": "1.0.0", "name": "n", "type": "bridge", "socket": str(sock), "ipam": ipam, **extra}
    ).encode()


ENV = {
    "CNI_COMMAND": "ADD",
    "CNI_CONTAINERID": "c1",
    "CNI_NETNS": "/run/netns/x",
    "CNI_IFNAME": "eth0",
    "CNI_PATH": "/opt/cni/bin",
    "CNI_ARGS": "K8S_POD_NAME=p;IgnoreUnknown=1",
    "UNRELATED": "not forwarded",
}


def launcher_env(sock: Path, **extra: str) -> dict[str, str]:
    return {**ENV, thick.ENV_SOCKET: str(sock), **extra}


def test_a_thick_call_is_forwarded_as_bytes_and_answered_verbatim_without_python(
    bundle: Path, sockdir: Path, agent: Callable[..., StandIn]
) -> None:
    reply = 'result with "quotes", a backslash \\, a newline\n, é ☃ and 😀'.encode() + b"\0\xff raw"
    a = agent(answers(0, reply))
    stdin = conf(sockdir / "cni.sock", note='a "b"\tc \\u0000 é') + b"\n"
    code, out, ran = run(bundle, launcher_env(sockdir / "cni.sock"), stdin)
    assert (code, out, ran) == (0, reply, None)
    ((env, got_stdin),) = a.requests
    assert env == {k: v for k, v in ENV.items() if k.startswith("CNI_")} and got_stdin == stdin


def test_the_agent_s_exit_status_is_passed_on(bundle: Path, sockdir: Path, agent: Callable[..., StandIn]) -> None:
    err = json.dumps({"cniVersion": "1.0.0", "code": 7, "msg": "invalid network config", "details": "mtu"}).encode()
    agent(answers(1, err))
    assert run(bundle, launcher_env(sockdir / "cni.sock"), conf(sockdir / "cni.sock")) == (1, err, None)


def test_an_agent_that_takes_the_request_and_dies_is_error_11(
    bundle: Path, sockdir: Path, agent: Callable[..., StandIn]
) -> None:
    def die(a: StandIn, conn: socket.socket, env: dict[str, str], stdin: bytes) -> None:
        a.ack_and_go(conn)  # GO: the request is the agent's now; then it is gone

    a = agent(die)
    code, out, ran = run(bundle, launcher_env(sockdir / "cni.sock"), conf(sockdir / "cni.sock"))
    err = json.loads(out)
    assert code == 1 and err["code"] == 11 and err["cniVersion"] == "1.0.0" and err["msg"] == "try again later"
    assert str(sockdir / "cni.sock") in err["details"] and err["details"].endswith("retry the operation")
    assert ran is not None and thick.ENV_AGENT_LOST in ran  # Python printed it, and did not redo the work
    assert len(a.requests) == 1 and a.got_go == 1


def test_a_malformed_answer_after_go_is_error_11(bundle: Path, sockdir: Path, agent: Callable[..., StandIn]) -> None:
    def bad(a: StandIn, conn: socket.socket, env: dict[str, str], stdin: bytes) -> None:
        a.ack_and_go(conn)
        conn.sendall(thick.encode_reply(7, b"exit status 7 is not a CNI exit status"))

    agent(bad)
    code, out, _ = run(bundle, launcher_env(sockdir / "cni.sock"), conf(sockdir / "cni.sock"))
    assert code == 1 and json.loads(out)["code"] == 11


def test_a_config_for_another_agent_gets_not_here_and_python_asks_that_one(
    bundle: Path, sockdir: Path, agent: Callable[..., StandIn]
) -> None:
    def not_here(a: StandIn, conn: socket.socket, env: dict[str, str], stdin: bytes) -> None:
        conn.sendall(thick.NOT_HERE)

    default = agent(not_here, "default.sock")
    other = agent(answers(0, b"{}"), "other.sock")
    stdin = conf(sockdir / "other.sock")
    code, out, ran = run(bundle, launcher_env(sockdir / "default.sock"), stdin)
    assert (code, out) == (0, b"{}") and ran is not None
    assert len(default.requests) == 1 and len(other.requests) == 1 and other.requests[0][1] == stdin


def test_a_stuck_agent_is_asked_once_and_waited_for_once(
    bundle: Path, sockdir: Path, agent: Callable[..., StandIn], tmp_path: Path
) -> None:
    """It never ACKs: the launcher hands its connection to Python, which waits out the rest of agentTimeout on it
    and then works standalone; the agent saw one request and never got GO."""
    release = threading.Event()

    def mute(a: StandIn, conn: socket.socket, env: dict[str, str], stdin: bytes) -> None:
        release.wait(30)

    a = agent(mute)
    stdin = ipam_only(sockdir / "cni.sock", tmp_path, agentTimeout=thick.LAUNCHER_ACK_WAIT + 0.2)
    try:
        code, out, ran = run(bundle, launcher_env(sockdir / "cni.sock"), stdin)
    finally:
        release.set()
    assert code == 0 and json.loads(out)["ips"][0]["address"] == "10.61.0.2/24"  # standalone did it
    assert ran is not None and thick.ENV_AGENT_FD in ran and thick.ENV_AGENT_WAITED in ran
    assert len(a.requests) == 1 and a.got_go == 0


def test_a_slow_agent_keeps_its_request_after_the_launcher_hands_it_on(
    bundle: Path, sockdir: Path, agent: Callable[..., StandIn], tmp_path: Path
) -> None:
    def slow(a: StandIn, conn: socket.socket, env: dict[str, str], stdin: bytes) -> None:
        threading.Event().wait(thick.LAUNCHER_ACK_WAIT + 0.3)  # the agent is busy beyond the launcher's wait
        a.ack_and_go(conn)
        conn.sendall(thick.encode_reply(0, b'{"from": "the agent"}'))

    a = agent(slow)
    stdin = ipam_only(sockdir / "cni.sock", tmp_path, agentTimeout=30)
    code, out, ran = run(bundle, launcher_env(sockdir / "cni.sock"), stdin)
    assert (code, out) == (0, b'{"from": "the agent"}') and ran is not None
    assert len(a.requests) == 1 and a.got_go == 1 and not list(tmp_path.glob("*.db"))  # not done twice


def test_a_refusal_of_the_agent_the_config_names_is_printed(
    bundle: Path, sockdir: Path, agent: Callable[..., StandIn]
) -> None:
    """NAK (answered without running: a request larger than the agent takes, refused before it is read) is the
    launcher's agent's answer only for a config naming it, which only Python can tell: it asks the config's socket,
    here the same agent, and prints that refusal."""
    err = b'{"cniVersion": "1.1.0", "code": 7, "msg": "invalid network config", "details": "too large"}'
    a = agent(lambda a, conn, env, stdin: conn.sendall(thick.NAK + thick.encode_reply(1, err)))
    code, out, ran = run(bundle, launcher_env(sockdir / "cni.sock"), conf(sockdir / "cni.sock"))
    assert (code, out) == (1, err) and ran is not None and len(a.requests) == 2 and a.got_go == 0


def test_a_refusal_by_an_agent_the_config_does_not_name_is_not_the_answer(
    bundle: Path, sockdir: Path, agent: Callable[..., StandIn], tmp_path: Path
) -> None:
    """Regression (issue 18, item 6): the agent at the launcher's socket refused an oversized request for another
    socket, and that refusal was the answer. Now the agent the config names answers it, or, with none there, the
    standalone path does the work."""
    err = b'{"cniVersion": "1.1.0", "code": 7, "msg": "invalid network config", "details": "too large"}'
    refusing = agent(lambda a, conn, env, stdin: conn.sendall(thick.NAK + thick.encode_reply(1, err)), "default.sock")
    other = agent(answers(0, b'{"from": "the other agent"}'), "other.sock")
    code, out, ran = run(bundle, launcher_env(sockdir / "default.sock"), conf(sockdir / "other.sock"))
    assert (code, out) == (0, b'{"from": "the other agent"}') and ran is not None
    assert len(refusing.requests) == 1 and len(other.requests) == 1 and other.got_go == 1
    code, out, _ = run(bundle, launcher_env(sockdir / "default.sock"), ipam_only(sockdir / "absent.sock", tmp_path))
    assert code == 0 and json.loads(out)["ips"][0]["address"] == "10.61.0.2/24"  # standalone did it
    assert len(refusing.requests) == 2


@pytest.fixture
def record(bundle: Path) -> Iterator[Path]:
    """The socket record install-cni writes beside the bundles (removed afterwards)."""
    path = bundle.parent / thick.SOCKET_RECORD
    yield path
    path.unlink(missing_ok=True)


def test_the_launcher_asks_the_agent_install_cni_recorded_without_python(
    bundle: Path, sockdir: Path, agent: Callable[..., StandIn], record: Path
) -> None:
    """No $NODEPLUG_CNI_SOCKET (no runtime sets it): the socket recorded beside the bundles is asked first, so a
    conflist naming an agent under another root keeps the fast path."""
    a = agent(answers(0, b'{"from": "the recorded agent"}'), "elsewhere.sock")
    record.write_text(f"{sockdir / 'elsewhere.sock'}\n")
    code, out, ran = run(bundle, ENV, conf(sockdir / "elsewhere.sock"))
    assert (code, out, ran) == (0, b'{"from": "the recorded agent"}', None)
    assert len(a.requests) == 1
    record.write_text(str(sockdir / "elsewhere.sock"))  # without the newline too
    assert run(bundle, ENV, conf(sockdir / "elsewhere.sock"))[2] is None


@pytest.mark.parametrize(
    "content", [b"", b"\n", b"relative/cni.sock\n", b"/a\0b\n", b"/two\n/lines\n", b"/" + b"x" * 200 + b"\n"]
)
def test_a_record_that_is_not_one_absolute_socket_path_is_ignored(
    bundle: Path, sockdir: Path, record: Path, content: bytes
) -> None:
    """The launcher then asks the default socket (whatever serves it on this machine), never a path made of the
    record's bytes."""
    record.write_bytes(content)
    _, _, ran = run(bundle, ENV, conf(sockdir / "absent.sock"))
    assert ran is not None
    tried = [line for line in ran.splitlines() if line.startswith(f"{thick.ENV_AGENT_TRIED}=")]
    assert tried in ([], [f"{thick.ENV_AGENT_TRIED}={thick.DEFAULT_SOCKET}"])  # [] : an agent there said NOT_HERE


@pytest.mark.parametrize(
    ("why", "env"),
    [
        ("no agent at the launcher's socket", {}),
        ("standalone forced", {"NODEPLUG_CNI_STANDALONE": "1"}),
        ("no command", {"CNI_COMMAND": ""}),
    ],
)
def test_otherwise_python_answers_with_stdin_intact(bundle: Path, sockdir: Path, why: str, env: dict[str, str]) -> None:
    # CHECK with no prevResult fails in Python before any netlink work: a cheap, exact answer to compare
    stdin = conf(sockdir / "absent.sock") + b" " * 70000  # longer than a pipe holds
    full = {**launcher_env(sockdir / "absent.sock"), "CNI_COMMAND": "CHECK", **env}
    code, out, ran = run(bundle, full, stdin)
    assert ran is not None, why
    assert (code, out) == python_entry(full, stdin), why


def test_stdin_beyond_the_limit_is_an_error_not_a_truncated_config(bundle: Path, sockdir: Path) -> None:
    stdin = conf(sockdir / "absent.sock") + b" " * thick.MAX_STDIN
    code, out, ran = run(bundle, launcher_env(sockdir / "absent.sock"), stdin)
    err = json.loads(out)
    assert code == 1 and err["code"] == 7 and str(thick.MAX_STDIN) in err["details"]
    assert ran is not None and f"{thick.ENV_STDIN_FAILED}=too large" in ran


def test_a_broken_bundle_answers_with_valid_json_naming_the_file_on_stderr(tmp_path: Path) -> None:
    d = tmp_path / 'odd "dir" \\ name'
    d.mkdir()
    compile_launcher(d)  # no _internal/loader: the entry point cannot start
    env = launcher_env(tmp_path / "absent.sock", CNI_COMMAND="DEL")  # an agent may serve the default socket
    p = subprocess.run([str(d / "nodeplug")], input=b"{}", env=env, capture_output=True)
    err = json.loads(p.stdout)
    assert p.returncode == 1 and err["code"] == 999 and "install-cni" in err["details"]
    assert str(d / "_internal" / "loader") in p.stderr.decode()


_EXAMPLE = itertools.count()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stdin=st.binary(max_size=3000), value=st.binary(max_size=40).filter(lambda b: b"\0" not in b))
def test_any_bytes_reach_the_agent_unchanged(
    bundle: Path, sockdir: Path, agent: Callable[..., StandIn], stdin: bytes, value: bytes
) -> None:
    path = sockdir / f"h{next(_EXAMPLE)}.sock"  # a fresh agent per example (the fixtures span all of them)
    a = agent(answers(0, stdin[::-1]), path.name)
    env = {**launcher_env(path), "CNI_ARGS": value.decode("utf-8", "surrogateescape")}
    full = {**env, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    p = subprocess.run([str(bundle / "nodeplug")], input=stdin, env=_bytes_env(full), capture_output=True, timeout=60)
    assert (p.returncode, p.stdout) == (0, stdin[::-1])
    ((got_env, got_stdin),) = a.requests
    assert got_stdin == stdin and got_env["CNI_ARGS"].encode("utf-8", "surrogateescape") == value


def _bytes_env(env: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode("utf-8", "surrogateescape") for k, v in env.items()}

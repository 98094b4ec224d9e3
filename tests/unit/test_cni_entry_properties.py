"""Whatever the bytes on stdin and the environment, the entry point prints exactly one result or spec error and exits
0 or 1 (issue 11, CNI 6): property tests over the entry point (in process, with the real commands over a fake
dataplane and an in-memory lease store, and a few real execs), the network config parser and the thick-mode framing,
which the agent must survive whatever a client sends."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cni import commands, entry, netconf, skel, thick, versions
from cni.config import Config
from cni.errors import CniError
from cni.ipam.store import MemoryStore
from cni.netconf import BridgeConf
from cni.plugin import CniPlugin
from cni.types import Interface, IPConfig, Result, Route
from nodeplug.paths import Root
from nodeplug.plugin import AgentContext

REPO = Path(__file__).resolve().parents[2]
SILENT_ON_SUCCESS = ("DEL", "CHECK", "GC", "STATUS")


class QuietDataplane:
    """Does nothing and succeeds: the properties are about the protocol, not the kernel."""

    def check_netns(self, netns: str) -> None: ...

    def add(
        self, conf: BridgeConf, cid: str, netns: str, ifname: str, ips: Sequence[IPConfig], routes: Sequence[Route]
    ) -> list[Interface]:
        return [Interface(conf.bridge), Interface("veth0"), Interface(ifname, sandbox=netns)]

    def delete(self, conf: BridgeConf, cid: str, netns: str | None, ifname: str, ips: Sequence[IPConfig]) -> None: ...

    def check(self, conf: BridgeConf, cid: str, netns: str, ifname: str, prev: Result) -> None: ...

    def gc(self, conf: BridgeConf, valid: Collection[tuple[str, str]]) -> None: ...

    def status(self, conf: BridgeConf) -> None: ...


def handlers() -> dict[str, skel.Handler]:
    store = MemoryStore()
    return commands.table(QuietDataplane(), lambda data_dir, network: store)


def assert_one_answer(command: str, code: int, out: str) -> None:
    assert code in (0, 1)
    if code == 0 and not out:
        assert command in SILENT_ON_SUCCESS
        return
    answer = json.loads(out)  # exactly one JSON document (json.loads refuses trailing data)
    assert isinstance(answer, dict)
    if code == 1:
        assert isinstance(answer["code"], int) and isinstance(answer["msg"], str) and answer["cniVersion"]


def nested(depth: int, inner: str = "1") -> bytes:
    return ("[" * depth + inner + "]" * depth).encode()


# ---------------------------------------------------------------- strategies

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
FIELDS = ["cniVersion", "name", "type", "bridge", "mtu", "ipam", "prevResult", "ipMasq", "isGateway", "vlan", "dns",
          "runtimeConfig", "args", "cni.dev/valid-attachments", "socket", "agentTimeout"]  # fmt: skip
BASE: dict[str, Any] = {
    "cniVersion": "1.1.0",
    "name": "prop",
    "type": "nodeplug",
    "ipam": {"type": "nodeplug", "ranges": [[{"subnet": "10.70.0.0/24"}]], "dataDir": "/nonexistent"},
}
PREV_RESULT = {
    "cniVersion": "1.1.0",
    "interfaces": [{"name": "eth0", "sandbox": "/run/netns/p"}],
    "ips": [{"address": "10.70.0.2/24", "interface": 0}],
}
BASES = [BASE, {**BASE, "type": "bridge"}, {**BASE, "prevResult": {"interfaces": [{"name": "eth0"}]}},
         {**BASE, "prevResult": PREV_RESULT}, {**BASE, "cni.dev/valid-attachments": []}]  # fmt: skip
configs = st.builds(
    lambda base, changes: json.dumps({**base, **changes}).encode(),
    st.sampled_from(BASES),
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=3),
)
stdins = st.one_of(
    st.sampled_from(BASES).map(lambda conf: json.dumps(conf).encode()),  # valid: the commands run to the end
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    configs,
    st.integers(min_value=1, max_value=3000).map(nested),
    st.sampled_from([b"NaN", b'{"cniVersion": "1.0.0", "mtu": NaN}', b'{"a": Infinity}', b"\xff\xfe{}"]),
)
env_text = st.binary(max_size=30).map(lambda b: b.replace(b"\0", b"").decode("utf-8", "surrogateescape"))
hostile_envs = st.fixed_dictionaries(
    {"CNI_COMMAND": st.sampled_from([*skel.COMMANDS, "", "BOGUS"])},
    optional={
        "CNI_CONTAINERID": st.one_of(st.just("c1"), env_text, st.text(alphabet="ab-1", min_size=200, max_size=300)),
        "CNI_NETNS": st.one_of(st.just("/run/netns/p"), env_text),
        "CNI_IFNAME": st.one_of(st.just("eth0"), env_text),
        "CNI_PATH": st.one_of(st.just("/opt/cni/bin"), env_text),
        "CNI_ARGS": st.one_of(st.just("IgnoreUnknown=1;K8S_POD_NAME=p"), env_text),
        # the launcher's notes (not NODEPLUG_CNI_AGENT_FD: a number may name one of this test process's own fds)
        thick.ENV_AGENT_WAITED: st.one_of(st.sampled_from(["-inf", "nan", "-1", "1e400"]), env_text),
        thick.ENV_AGENT_TRIED: st.one_of(st.just(thick.DEFAULT_SOCKET), env_text),
        thick.ENV_AGENT_LOST: env_text,
        thick.ENV_STDIN_FAILED: st.one_of(st.just("too large"), env_text),
    },
)
# Well formed: the invocation gets past the environment checks, so the config and the commands are exercised too (the
# hostile variables alone almost never make a complete, valid set).
WELL_FORMED_ENV = {"CNI_CONTAINERID": "c1", "CNI_NETNS": "/run/netns/p", "CNI_IFNAME": "eth0", "CNI_PATH": "/x"}
well_formed_envs = st.sampled_from(skel.COMMANDS).map(lambda command: {**WELL_FORMED_ENV, "CNI_COMMAND": command})
envs = st.one_of(hostile_envs, well_formed_envs).map(lambda env: {**env, "NODEPLUG_CNI_STANDALONE": "1"})


# ---------------------------------------------------------------- the entry point in process


@settings(max_examples=400, deadline=None)
@given(env=envs, stdin=stdins)
def test_any_input_gets_exactly_one_answer(env: dict[str, str], stdin: bytes) -> None:
    out = io.StringIO()
    code = entry.run(env, io.BytesIO(stdin), out, handlers())
    assert_one_answer(env["CNI_COMMAND"], code, out.getvalue())


def test_a_well_formed_add_gets_through_to_the_commands() -> None:
    """The property above reaches the commands: its base config and well-formed environment make a working ADD."""
    out = io.StringIO()
    env = {**WELL_FORMED_ENV, "CNI_COMMAND": "ADD", "NODEPLUG_CNI_STANDALONE": "1"}
    assert entry.run(env, io.BytesIO(json.dumps(BASE).encode()), out, handlers()) == 0, out.getvalue()
    assert json.loads(out.getvalue())["ips"][0]["address"].startswith("10.70.0.")


@pytest.mark.parametrize("command", ["ADD", "DEL", "CHECK", "VERSION"])
def test_a_thousand_levels_of_nesting_is_a_decode_error_not_a_crash(command: str, tmp_path: Path) -> None:
    """Regression (issue 11, CNI 6): RecursionError escaped and stdout stayed empty, standalone and thick alike (the
    entry point reads the config to find the agent)."""
    env = {"CNI_COMMAND": command, "CNI_CONTAINERID": "c1", "CNI_NETNS": "/run/netns/p", "CNI_IFNAME": "eth0",
           "CNI_PATH": "/opt/cni/bin"}  # fmt: skip
    for stdin in (nested(1000), b'{"socket": "%s", "x": %s}' % (str(tmp_path / "a.sock").encode(), nested(1000))):
        out = io.StringIO()
        code = entry.run(env, io.BytesIO(stdin), out)  # fails before any netlink work
        assert_one_answer(command, code, out.getvalue())
        if command != "VERSION":
            assert json.loads(out.getvalue())["code"] == 6


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_json_numbers_are_refused(literal: bytes) -> None:
    """Regression (issue 11, CNI 10): ``NaN`` passed the config decoder."""
    stdin = b'{"cniVersion": "1.1.0", "name": "n", "type": "nodeplug", "mtu": ' + literal + b"}"
    env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_NETNS": "/run/netns/p", "CNI_IFNAME": "eth0",
           "CNI_PATH": "/x", "NODEPLUG_CNI_STANDALONE": "1"}  # fmt: skip
    out = io.StringIO()
    assert entry.run(env, io.BytesIO(stdin), out) == 1  # fails before any netlink work
    err = json.loads(out.getvalue())
    assert err["code"] == 6 and literal.decode().lstrip("-") in err["details"]


@pytest.mark.parametrize(
    "stdin", [nested(1000), b"\xff\xfe\x00garbage", b'{"cniVersion": "1.0.0", "mtu": NaN}', nested(100_000)]
)
def test_real_execs_answer_once(stdin: bytes) -> None:
    env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_NETNS": "/run/netns/p", "CNI_IFNAME": "eth0",
           "CNI_PATH": "/x", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}  # fmt: skip
    p = subprocess.run(
        [sys.executable, "-c", "from cni.entry import main; main()"], input=stdin, env=env, capture_output=True,
        timeout=60,
    )  # fmt: skip
    assert p.stderr == b"", p.stderr.decode()
    assert_one_answer("ADD", p.returncode, p.stdout.decode())


# ---------------------------------------------------------------- the config parser


@settings(max_examples=400, deadline=None)
@given(stdin=stdins)
def test_the_config_parser_fails_only_with_spec_errors(stdin: bytes) -> None:
    """Any bytes: a spec error (decode 6, version 1, invalid 7) naming the problem, or a config that is what the
    bytes say: a JSON object whose name, supported cniVersion and socket the parsed config carries."""
    for command in ("ADD", "CHECK", "GC"):
        try:
            conf = skel.parse_conf(command, stdin)
        except CniError as e:
            assert e.code in (1, 6, 7) and e.details
            continue
        raw = json.loads(stdin)
        assert conf.raw == raw and conf.name == raw["name"] and conf.cni_version == raw["cniVersion"]
        assert conf.cni_version in versions.SUPPORTED
        given_type = raw.get("type")  # null reads as absent, as every optional field does
        if isinstance(conf, BridgeConf):
            assert conf.socket == (raw.get("socket") or thick.DEFAULT_SOCKET) and conf.socket.startswith("/")
            assert 0 < conf.agent_timeout <= 60 and conf.type == ("nodeplug" if given_type is None else given_type)
        else:  # nodeplug as another plugin's IPAM
            assert raw["ipam"]["type"] == "nodeplug" and conf.type == (given_type or "") != "nodeplug"
    try:
        parsed = netconf.parse(netconf.decode(stdin))
    except CniError as e:
        assert e.code in (6, 7) and e.details
    else:
        assert parsed.raw == json.loads(stdin)


# ---------------------------------------------------------------- the thick-mode framing

cni_envs = st.dictionaries(
    st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_", min_size=1, max_size=12).map(lambda k: "CNI_" + k), env_text
)


@given(env=cni_envs, stdin=st.binary(max_size=2000))
def test_a_request_reads_back_exactly(env: dict[str, str], stdin: bytes) -> None:
    data = thick.encode_request({**env, "PATH": "/bin", "HOME": "/root"}, stdin)
    env_size, stdin_size = thick.parse_header(data[: thick.HEADER_SIZE])
    assert thick.parse_body(data[thick.HEADER_SIZE :], env_size) == (env, stdin)
    assert thick.HEADER_SIZE + env_size + stdin_size == len(data)


@given(code=st.sampled_from([0, 1]), stdout=st.binary(max_size=2000))
def test_a_reply_reads_back_exactly(code: int, stdout: bytes) -> None:
    data = thick.encode_reply(code, stdout)
    assert thick.parse_reply_header(data[:5]) == (code, len(stdout)) and data[5:] == stdout


@given(data=st.binary(max_size=200))
def test_the_framing_refuses_garbage_with_its_own_error_only(data: bytes) -> None:
    """Any bytes: the framing's own error, or what the bytes say, exactly."""
    with contextlib.suppress(thick.ProtocolError):
        env_size, stdin_size = thick.parse_header(data[: thick.HEADER_SIZE])
        assert data.startswith(thick.MAGIC) and len(data) >= thick.HEADER_SIZE
        assert (env_size, stdin_size) == (int.from_bytes(data[4:8], "big"), int.from_bytes(data[8:12], "big"))
    with contextlib.suppress(thick.ProtocolError):
        env = thick.parse_env(data)
        assert all(k.startswith("CNI_") for k in env)
        assert thick.encode_env(env) == data or len(env) < data.count(b"\0")  # a repeated key: the last one wins
    with contextlib.suppress(thick.ProtocolError):
        code, size = thick.parse_reply_header(data[:5])
        assert len(data) >= 5 and code == data[0] in (0, 1) and size == int.from_bytes(data[1:5], "big")
        assert size <= thick.MAX_REPLY
    assert thick.routes_here(data, "/run/nodeplug/cni.sock") in (True, False)


@given(text=st.one_of(st.text(max_size=20), st.floats().map(str), st.sampled_from(["-inf", "-1e400", "nan", "-3"])))
def test_the_launchers_wait_is_a_finite_number_or_all_of_it(text: str) -> None:
    """NODEPLUG_CNI_AGENT_WAITED: what the launcher writes (a finite number >= 0) is taken as it is; anything else
    uses the whole wait up, so the entry point never waits past agentTimeout (regression: -inf raised, -3 made it
    wait 3 s longer)."""
    got = thick.waited(text)
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if 0 <= value < float("inf"):
        assert got == value
    else:
        assert got == float("inf")
    assert got >= 0


@pytest.fixture(scope="module")
def running_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The agent's CNI plugin on an event loop of its own thread, with the real protocol over a quiet dataplane."""
    root = Path(os.path.realpath(tmp_path_factory.mktemp("agent")))
    loop = asyncio.new_event_loop()
    config = Config(handshake_timeout=0.5, max_request_bytes=4096)
    plugin = CniPlugin(config, AgentContext(root=Root(root)), handlers=handlers())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(plugin.start(), loop).result(30)
    yield root / "run/nodeplug/cni.sock"
    asyncio.run_coroutine_threadsafe(plugin.stop(1.0), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def exchange(path: Path, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(path))
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.one_of(st.binary(max_size=300), st.binary(max_size=40).map(lambda b: thick.MAGIC + b)))
def test_the_agent_survives_any_bytes_and_still_serves(running_agent: Path, garbage: bytes) -> None:
    got = exchange(running_agent, garbage)
    if got:  # a whole request by chance: NAK or NOT_HERE, or ACK (never followed by a run: no GO was sent)
        assert got[:1] in (thick.ACK, thick.NAK, thick.NOT_HERE)
    stdin = json.dumps({**BASE, "socket": str(running_agent)}).encode()
    answer = thick.call(str(running_agent), {"CNI_COMMAND": "STATUS"}, stdin, timeout=10)
    assert answer is not None
    assert_one_answer("STATUS", answer[0], answer[1].decode())


@pytest.mark.parametrize("stdin", [nested(1000), b"NaN", b"\xff" * 10])
def test_the_agent_answers_hostile_configs_with_a_spec_error(running_agent: Path, stdin: bytes) -> None:
    """As the launcher sends them: it does not read the config, so the agent is the first to see it."""
    env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_NETNS": "/run/netns/p", "CNI_IFNAME": "eth0",
           "CNI_PATH": "/x"}  # fmt: skip
    answer = thick.call(str(running_agent), env, stdin, timeout=10)
    assert answer is not None
    code, out = answer
    assert code == 1 and json.loads(out)["code"] == 6

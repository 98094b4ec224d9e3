"""``deviceplugin.dra.enabled: auto``: DRA on where the cluster has it, off elsewhere. Pure.

Two parties know, and each is asked the way it answers anyway:

- **the API server**, through API discovery (:func:`deviceplugin.dra.kubeapi.served_version`): it serves
  ``resource.k8s.io`` in a version the driver speaks (v1, or v1beta1 on 1.32 and 1.33), or it says it serves none
  (``/apis/resource.k8s.io`` answers 404, or lists only other versions). While it does not answer, nothing is known.
- **this node's kubelet**, through its plugin watcher: the driver's registration socket is served from the start, and
  kubelet calls ``GetInfo`` and then reports the outcome with ``NotifyRegistrationStatus``. A kubelet that takes DRA
  plugins (feature gate ``DynamicResourceAllocation`` on, the default from 1.34) registers the driver. One that does
  not has no handler for the plugin type ``DRAPlugin`` and says exactly that: "RegisterPlugin error -- no handler
  registered for plugin type: DRAPlugin at socket ..." (kubelet's plugin manager; older kubelets without the
  "RegisterPlugin error -- " prefix). Any other refusal (a version kubelet cannot use, a name already taken) is a
  problem to report, not an answer: the driver stays undecided and not ready, as with ``enabled: true``.

DRA is on when both say yes and off as soon as either says no; otherwise it is not decided yet. A later answer
changes the decision (a kubelet restarted with DRA registers the driver again), and the driver follows it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DRA_PLUGIN = "DRAPlugin"
# kubelet's plugin manager, when it has no handler for the type a plugin's GetInfo named
_NO_HANDLER = re.compile(r"no handler registered for plugin type: ?(\S*)")


@dataclass(frozen=True)
class Answer:
    """One party's answer: ``says`` is True (has DRA), False (has not) or None (not known yet); ``why`` says so."""

    says: bool | None
    why: str


@dataclass(frozen=True)
class Decision:
    on: bool | None  # None: not decided yet
    reason: str

    def describe(self) -> str:
        state = {True: "DRA on", False: "DRA off", None: "DRA not decided yet"}[self.on]
        return f"{state}: {self.reason}"


UNKNOWN_API = Answer(None, "waiting for the API server's discovery of resource.k8s.io")


def api_answer(version: str, refusal: str = "") -> Answer:
    """The API server's answer: the version it serves, or why it serves none ("" for both: not reached yet)."""
    if version:
        return Answer(True, f"the API server serves resource.k8s.io/{version}")
    if refusal:
        return Answer(False, refusal)
    return UNKNOWN_API


def takes_no_dra(error: str) -> bool:
    """Whether a registration refusal is kubelet saying it has no handler for DRA plugins."""
    m = _NO_HANDLER.search(error)
    return m is not None and m.group(1) == DRA_PLUGIN


def kubelet_answer(registered: bool | None, error: str, called: bool = False) -> Answer:
    """kubelet's answer from what its plugin watcher last reported (``registered`` None: nothing reported yet)."""
    if registered:
        return Answer(True, "kubelet registered the DRA plugin")
    if registered is None:
        if called:
            return Answer(None, "kubelet asked for the DRA plugin's info, registration outcome not reported yet")
        return Answer(None, "waiting for kubelet's plugin watcher to register the DRA plugin")
    if takes_no_dra(error):
        return Answer(False, f"this node's kubelet takes no DRA plugins (DynamicResourceAllocation off): {error}")
    return Answer(None, f"kubelet rejected the DRA plugin: {error or 'no reason given'}")


def decide(api: Answer, kubelet: Answer) -> Decision:
    """On when both have DRA, off when either has not (the API server's answer named first), else not yet."""
    for a in (api, kubelet):
        if a.says is False:
            return Decision(False, a.why)
    if api.says and kubelet.says:
        return Decision(True, f"{api.why}; {kubelet.why}")
    return Decision(None, "; ".join(a.why for a in (api, kubelet) if a.says is None))

"""The ``deviceplugin.dra`` section: the node's devices also served as a DRA driver.

::

    deviceplugin:
      dra:
        enabled: auto                   # auto | true | false (see below)
        driver_name: devices.nodeplug.io
        api_version: auto               # resource.k8s.io: auto (v1 when served, else v1beta1) | v1 | v1beta1
        state_dir: /var/lib/nodeplug/dra   # the prepared-claims database
        resync_seconds: 300             # safety re-check of the published slices
      resources:
        - name: fuse
          devices: [/dev/fuse]
          offer: both                   # deviceplugin (the default) | dra | both

``enabled``: ``true`` serves kubelet's DRA API and publishes this node's ResourceSlices (an error without a
Kubernetes API); ``false`` does neither; ``auto`` (the default) is ``true`` where the cluster has DRA: the agent
follows an API server that serves ``resource.k8s.io`` v1 or v1beta1, and this node's kubelet registers the driver
(see :mod:`deviceplugin.dra.auto`); elsewhere DRA is off, said once in the log and in ``/readyz``.

The API server and this node's name are the agent's (``nodeplug agent --kubeconfig``, ``KUBECONFIG`` or the
service account; ``--node-name`` or ``NODE_NAME``). Which resources DRA offers is each resource's ``offer``; the
default ``deviceplugin`` changes nothing for existing configs. A resource offered ``both`` hands each replica
to one side at a time, and DRA offers every replica of a shared device as a device of its own (see
:mod:`deviceplugin.dra.inventory`).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

DRIVER_NAME = "devices.nodeplug.io"
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class DraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: Literal["auto"] | StrictBool = "auto"
    driver_name: str = DRIVER_NAME
    api_version: Literal["auto", "v1", "v1beta1"] = "auto"
    state_dir: str = "/var/lib/nodeplug/dra"
    resync_seconds: float = Field(default=300.0, ge=5, le=86400)

    @field_validator("driver_name")
    @classmethod
    def _driver(cls, v: str) -> str:
        if len(v) > 63 or not _DNS_SUBDOMAIN.match(v) or "." not in v:
            raise ValueError("expected a lower-case DNS subdomain with a dot, at most 63 characters")
        return v

    @field_validator("state_dir")
    @classmethod
    def _abs(cls, v: str) -> str:
        if not v.startswith("/") or "\x00" in v or ".." in v.split("/"):
            raise ValueError("expected an absolute path without '..'")
        return v

"""``nodeplug install-cni [--uninstall]``: put the CNI entry point and its conflist on the host, and take them away.

What it owns on the host (paths under ``--root``, default ``/``)::

    /opt/cni/bin/nodeplug            symlink -> nodeplug.d/<id>/nodeplug   (what the runtime execs)
    /opt/cni/bin/nodeplug.d/<id>/    one self-contained bundle per installed build (scripts/build-cni-bundle);
                                     <id> is a hash of its content, so the same build installs to the same place
    /opt/cni/bin/nodeplug.d/agent-socket
                                     the agent socket the conflist names, one line: the launcher (which reads no
                                     JSON) asks that agent first
    /etc/cni/net.d/10-nodeplug.conflist

Install is atomic at every step a runtime can observe: the bundle is copied into ``nodeplug.d/.tmp-<id>-<pid>``,
synced, and renamed to ``nodeplug.d/<id>``; it is run once (``CNI_COMMAND=VERSION``) before anything points at it;
then a new symlink is renamed over ``nodeplug``, so an exec sees the old build or the new one, never a half-copied
file. The build the symlink pointed at before stays (a plugin still running from it keeps its files); older builds
are removed. The conflist is written to a temp name the runtime ignores and renamed into place. Running it again
with the same inputs changes nothing. A crash at any point leaves either the old or the new state plus, at worst,
a ``.tmp-*`` directory, which the next run removes. One install runs at a time on a host: the DaemonSet has one pod
per node and replaces it without surge.

It never touches files it did not write: an existing ``nodeplug`` that is not a symlink into ``nodeplug.d/``, or a
conflist of that name without a ``"type": "nodeplug"`` plugin, stops the install with an error (``--force`` takes
them over). ``--uninstall`` removes exactly the symlink, ``nodeplug.d/``, our conflist and the reference plugins it
copied, and, in the node's network namespace, what nodeplug's networks left there (:mod:`cni.install.network`:
the unused pod bridge and masquerade table, and the cluster network, which the running agent is asked to give up
until the next install), and nothing else.

Reference plugins: container runtimes exec ``loopback`` for every pod sandbox (containerd's CRI fails the sandbox
without it) and a conflist may chain ``portmap``. When the bin dir lacks them they are copied from
``--reference-plugins`` (the image's Debian containernetworking-plugins, ``/usr/lib/cni``) by
:mod:`cni.install.refplugins`, which never overwrites or removes a host's own copy.

The conflist is generated from the flags (bridge, subnets or the cluster network's node subnets, masquerade) or taken
from ``--conflist-file``; either way every nodeplug plugin in it is checked with the same parser the entry point uses
before the host is touched. ``--cluster-network`` makes the conflist of the cluster pod network: IPAM ranges from this
node's podCIDRs (``ipam.nodeSubnets``, the file the agent keeps) and no per-pod masquerade (the agent masquerades
traffic leaving the cluster CIDRs, so pod-to-pod traffic keeps its source address).

Modules: :mod:`cni.install.bundle` (the entry point's bundle and symlink), :mod:`cni.install.conflist` (the network
config), :mod:`cni.install.refplugins` (loopback, portmap), :mod:`cni.install.network` (what the networks left in
the node's network namespace) and :mod:`cni.install.cli` (the command).
"""

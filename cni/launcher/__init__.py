"""The CNI bundle's launcher: a small static C program (``launcher.c``, ``fastpath.c``) that the runtime execs as
``/opt/cni/bin/nodeplug``. It answers VERSION and hands invocations to the agent (:mod:`cni.thick`) without starting
Python, and otherwise runs the frozen entry point (:mod:`cni.entry`). Its constants are generated from the Python
modules that own them (:mod:`cni.launcher.protocol`); ``scripts/build-cni-bundle`` compiles it.
"""

"""The eBPF redirect of established pod flows past the node's forwarding path (``cluster_network.redirect``).

:mod:`cni.redirect.program` says what the program does and why it is safe; :mod:`cni.redirect.manager` where the
agent attaches it and when; :mod:`cni.redirect.bpf`, :mod:`cni.redirect.btf` and :mod:`cni.redirect.asm` are the
kernel interfaces it is built on (the bpf() system call, the kernel's type information, the instruction encoding).
"""

"""CNI plugin (spec 1.1.0): bridge + veth pod networks with crash-safe IPAM.

The entry point (``cni.entry``) must import the standard library only on its start-up path.
"""

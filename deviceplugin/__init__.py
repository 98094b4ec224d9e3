"""kubelet device plugin (v1beta1): discovery, health, allocation, CDI, registration.

Layers, each importing only those above it:

- pure core: :mod:`config` (the section), :mod:`discovery` (devices under a host root), :mod:`state` (the device
  table and health reasons), :mod:`policy` (preferred allocation, Allocate checks), :mod:`cdi` (container edits,
  CDI specs), :mod:`broadcast` (latest-value fan-out to streams);
- edges: :mod:`health` (health/reset commands), :mod:`inotify`, :mod:`uevent`, :mod:`servicer` (v1beta1
  DevicePlugin), :mod:`registration` (Register with kubelet), :mod:`metrics`;
- lifecycle: :mod:`resource` (one resource: socket, registration, health loop), :mod:`plugin` (all resources,
  change detection, reload; ``create`` for the agent shell), :mod:`doctor`;
- the DRA driver: :mod:`deviceplugin.dra` (on the same resources, started by :mod:`plugin` when enabled).

The kubelet stand-in and fake host of the tests and the benchmark live in scripts/lab.
"""

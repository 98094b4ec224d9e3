"""The DRA driver ``devices.nodeplug.io``: the device plugin's devices also served through Dynamic Resource
Allocation (kubelet's ``dra`` gRPC API ``v1beta1`` and ``v1``; ``resource.k8s.io`` through the API server).

Layers, each importing only those above it:

- pure core: :mod:`config` (the ``deviceplugin.dra`` section), :mod:`names` (Kubernetes names, device names in the
  pool), :mod:`claims` (a ResourceClaim reduced to this driver's allocation), :mod:`slices` (the ResourceSlices that
  should be published, and reading back those that are), :mod:`claimcdi` (a claim's CDI spec);
- state: :mod:`store` (prepared claims in SQLite);
- core logic over protocols: :mod:`prepare` (NodePrepare/NodeUnprepare for one claim), :mod:`inventory` (one device,
  one side: the holds between the device plugin and DRA);
- edges: :mod:`servicer` (both gRPC packages), :mod:`kubeapi` (API requests), :mod:`publisher` (the slices kept
  current), :mod:`podresources` (kubelet's pod-resources API);
- lifecycle: :mod:`driver` (started and stopped by :mod:`deviceplugin.plugin`).
"""

"""The simulated Kubernetes control plane: object store, API semantics and controllers.

``store`` keeps API objects as plain JSON dicts with resourceVersions;
``api`` serves them over the real REST paths; ``controllers`` reproduce what
the Deployment/ReplicaSet, LeaderWorkerSet, EndpointSlice, scheduler, node
lifecycle and kubelet do to those objects.
"""

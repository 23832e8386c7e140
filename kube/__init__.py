"""The ground floor's Kubernetes room: the API client, informers, the leader-election lease.

Everything above it that talks to the cluster (activities, the gateway's control plane,
the worker's fast path and alert intake) builds its clients and watches here, so no floor
has to reach upward for them. It imports nothing of fleetmend's (DESIGN.md §1).
"""

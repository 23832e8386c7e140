"""fleetmend's gateway control plane: what Envoy, the gateway in front of the engines, is told (xDS).

Envoy dials this control plane (ADS over gRPC, state of the world, ``gateway.server``) and gets, for
every pool (a Kubernetes Service):

* a cluster (CDS) with active health checks on the engines' ``/health``, outlier detection, the
  retry budget and the queue bound as circuit breakers;
* its endpoints (EDS): the EndpointSlice's ready endpoints whose pods carry the router-only label,
  each with the ramp weight fleetmend set (``load_balancing_weight``);
* a virtual host (RDS) answering the pool's Service names: shed tiers (a request header) get a
  503 with ``Retry-After`` from Envoy itself, a share of one tier is shed by a runtime fraction,
  and the rest goes to the cluster with retries only before a response started.

What fleetmend wants per pool lives in Postgres (``gateway_policies``, written by the adapter in
``activities/envoy_gateway.py`` inside ledger effects); the endpoints come from the Kubernetes API.
Both survive any restart: an Envoy that reconnects, or a control plane that restarts, rebuilds the
same snapshot. Envoy's ACKs and NACKs (with its error text) are written back to ``gateway_acks``,
which is how the adapter knows a change was applied, or refused.
"""

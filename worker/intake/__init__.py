"""Alert intake, shared by the alert webhook and the fast path.

Routing rules (``rules.yaml``), the Alertmanager alert they route, the pool topology
that resolves an alert's node or pod to replica groups, and the signal-with-start that
delivers each loss report to its pool's ``FleetIncident``. The webhook feeds it
Alertmanager's notifications; the fast path feeds it what its own watches confirmed.
"""

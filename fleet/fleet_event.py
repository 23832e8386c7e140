"""A fleet event: losses in several pools that share a cause, named once.

The runbook's pre-check correlates losses inside one pool ("several replicas leaving inside a minute
is a rollout, a node-pool operation ... not four coincidences"). Across pools the same holds: a rack
that loses power takes 16 nodes and a dozen pools at once, and a dozen unrelated incidents would each
notify on their own. So every node the fast path confirms lost also joins the fleet event of each of
its topology domains (``topology.kubernetes.io/rack`` and ``.../zone`` by default: the setting
``fleet_event_topology_labels``), one workflow per domain (``fleet-event/<label>/<value>``). After the
correlation window the event decides here: two or more nodes of one domain, in two or more pools, lost
inside the window is a common cause; it is named once, with its evidence, and one notification lists
every pool hit (each pool's own incident still runs its recovery). One node, or one pool, is not a
fleet event: the pool's incident covers it, and the event closes without a word.

Pure: the workflow is ``workflows/fleet_event.py``.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from fleet.incident import PoolRef


class NodeLoss(BaseModel):
    """One node the fast path confirmed lost, as it joins a domain's fleet event."""

    node: str
    pools: list[PoolRef]
    evidence: str
    at: float
    domains: dict[str, str] = Field(
        default_factory=dict, description="The node's failure domains (label -> value)"
    )


class CommonCause(BaseModel):
    common: bool
    summary: str
    nodes: list[str] = Field(default_factory=list)
    pools: list[str] = Field(default_factory=list)


def fleet_event_workflow_id(label: str, value: str) -> str:
    """One open event per topology domain; a loss after it closed opens the domain's next one."""
    return f"fleet-event/{label}/{value}"


def common_cause(
    label: str,
    value: str,
    losses: list[NodeLoss],
    window_s: float,
    narrower: list[str] | tuple[str, ...] = (),
) -> CommonCause:
    """Is this domain's set of losses one cause across pools? Two or more nodes in two or more pools.
    ``narrower``: the domain labels inside this one (a zone's racks): when every loss lies in one of those
    domains, that domain's own event names the cause and this one stays quiet (one post per cause)."""
    nodes = sorted({loss.node for loss in losses})
    pools = sorted({p.key for loss in losses for p in loss.pools})
    span = max(loss.at for loss in losses) - min(loss.at for loss in losses) if losses else 0.0
    where = f"{label}={value}"
    for inner in narrower:
        values = {loss.domains.get(inner) for loss in losses}
        if len(values) == 1 and None not in values:
            return CommonCause(
                common=False,
                summary=f"{where}: every loss is in {inner}={values.pop()}: that domain's event names the cause",
                nodes=nodes,
                pools=pools,
            )
    if len(nodes) < 2 or len(pools) < 2:
        return CommonCause(
            common=False,
            summary=f"{where}: {len(nodes)} node(s), {len(pools)} pool(s) lost within {window_s:g} s: "
            "no common cause across pools (each pool's incident handles its own loss)",
            nodes=nodes,
            pools=pools,
        )
    return CommonCause(
        common=True,
        summary=f"common cause: {where} lost {len(nodes)} nodes within {span:.1f} s, hitting {len(pools)} "
        f"pools ({', '.join(pools)}); each pool's incident recovers its own replicas, every node is fenced "
        "once (fence/<node>)",
        nodes=nodes,
        pools=pools,
    )

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

**Node-level causes.** A bad driver, kernel or node image takes nodes wherever they stand, not one
rack's. So a lost node also joins the event of each of its node-level attributes (node labels: the
setting ``fleet_event_node_labels``; by default the driver version NVIDIA GPU Feature Discovery
publishes, ``nvidia.com/cuda.driver-version.full``, the kernel version Node Feature Discovery
publishes, ``feature.node.kubernetes.io/kernel-version.full``, and the instance type). Such an event
names a *suspected* cause only with contrast: two or more nodes in two or more pools, not all inside
one topology domain (then that domain's event names it), and a value that only part of the fleet's
nodes carry while every node down at that moment carries it (``NodeAttribute``, counted from the
node watch when the node was lost). Every node of a homogeneous fleet shares its driver, and a burst of
unrelated losses hits each driver in proportion: neither is evidence, and nothing is said.

Pure: the workflow is ``workflows/fleet_event.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from pydantic import BaseModel, Field

from fleet.incident import PoolRef


class NodeAttribute(BaseModel):
    """A lost node's value of a node-level label, and how the fleet's nodes, and the ones down at that
    moment, shared it."""

    value: str
    holding: int = Field(ge=0, description="Nodes carrying the label with this value")
    carrying: int = Field(ge=0, description="Nodes carrying the label at all")
    down_holding: int = Field(0, ge=0, description="Of the nodes not Ready now, those with this value")
    down_carrying: int = Field(0, ge=0, description="Of the nodes not Ready now, those with the label")


class NodeLoss(BaseModel):
    """One node the fast path confirmed lost, as it joins a domain's fleet event."""

    node: str
    pools: list[PoolRef]
    evidence: str
    at: float
    domains: dict[str, str] = Field(
        default_factory=dict, description="The node's failure domains (label -> value)"
    )
    attributes: dict[str, NodeAttribute] = Field(
        default_factory=dict, description="The node's node-level attributes (label -> value and fleet share)"
    )


class CommonCause(BaseModel):
    common: bool
    suspected: bool = Field(False, description="A node-level attribute: named as a suspect, not as fact")
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
    ``narrower``: the domain labels inside this one (a zone's racks; for a node-level attribute, every
    topology label): when every loss lies in one of those domains, that domain's own event names the
    cause and this one stays quiet (one post per cause). A node-level attribute (the losses carry it
    in ``attributes``) is named only as a suspect, and only when part of the fleet runs another value."""
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
    shares = [a for loss in losses if (a := loss.attributes.get(label)) is not None]
    if shares:
        share = shares[-1]  # the fleet as the newest loss saw it
        spread = ", ".join(
            f"{inner} {'/'.join(sorted(v))}"
            for inner in narrower
            if len(v := {loss.domains[inner] for loss in losses if inner in loss.domains}) > 1
        )
        if share.holding >= share.carrying:
            return CommonCause(
                common=False,
                summary=f"{where}: every one of the fleet's {share.carrying} node(s) with {label} has "
                f"{value}: shared by all, no evidence of a common cause",
                nodes=nodes,
                pools=pools,
            )
        # Any moment of the window when a node was down on another value: not concentrated.
        mixed = max(shares, key=lambda a: a.down_carrying - a.down_holding)
        if mixed.down_holding < mixed.down_carrying:
            return CommonCause(
                common=False,
                summary=f"{where}: {mixed.down_carrying - mixed.down_holding} of the {mixed.down_carrying} "
                f"node(s) down with {label} run another value: the losses are not concentrated on {value}",
                nodes=nodes,
                pools=pools,
            )
        return CommonCause(
            common=True,
            suspected=True,
            summary=f"suspected node-level cause: {where} on all {len(nodes)} nodes lost within {span:.1f} s "
            f"({spread or 'across domains'}), hitting {len(pools)} pools ({', '.join(pools)}); "
            f"every node down runs it, {share.holding} of the fleet's {share.carrying} node(s) with "
            f"{label} do. Each pool's "
            "incident recovers its own replicas, every node is fenced once (fence/<node>)",
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


class AttributeTally:
    """How the fleet's nodes share each node-level label's values, kept from node events (the fast
    path's node watch): a node's change costs its labels, never a pass over the fleet."""

    def __init__(self, labels: list[str] | tuple[str, ...]) -> None:
        self._labels = tuple(labels)
        self._nodes: dict[str, tuple[dict[str, str], bool]] = {}  # node -> (attributes, down)
        self._holding: Counter[tuple[str, str, bool]] = Counter()  # (label, value, down)
        self._carrying: Counter[tuple[str, bool]] = Counter()  # (label, down)

    def update(self, node: str, labels: Mapping[str, str] | None, *, down: bool = False) -> None:
        """The node as its event shows it (None: deleted; ``down``: not Ready)."""
        old, was_down = self._nodes.pop(node, ({}, False))
        for label, value in old.items():
            self._holding[(label, value, was_down)] -= 1
            self._carrying[(label, was_down)] -= 1
        if labels is None:
            return
        mine = {label: str(labels[label]) for label in self._labels if labels.get(label)}
        for label, value in mine.items():
            self._holding[(label, value, down)] += 1
            self._carrying[(label, down)] += 1
        if mine:
            self._nodes[node] = (mine, down)

    def attributes(self, node: str) -> dict[str, NodeAttribute]:
        """The node's node-level attributes, each with how the fleet, and the nodes down, share it now."""
        mine, _ = self._nodes.get(node, ({}, False))
        return {
            label: NodeAttribute(
                value=value,
                holding=self._holding[(label, value, True)] + self._holding[(label, value, False)],
                carrying=self._carrying[(label, True)] + self._carrying[(label, False)],
                down_holding=self._holding[(label, value, True)],
                down_carrying=self._carrying[(label, True)],
            )
            for label, value in mine.items()
        }

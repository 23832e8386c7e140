"""A pod that is deleted between observe and act (a LeaderWorkerSet restarting its group, a
controller replacing it): taking it out of service is already done, putting something on it is
refused — against the simulated API server, through the ledger."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from activities.readiness import PodConditionPatch
from activities.world_effects import PodMetadataPatch
from fleet.vocabulary import ROUTER_LABEL, SERVING_READY_CONDITION
from kube.client import KubeApis, kube_apis
from ledger import EffectLedger
from ledger.errors import EffectFailed
from sim.runner import start_sim
from sim.scenario import shipped_scenarios

GONE = "llama-70b-gone-0"


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeApis]:
    kubeconfig: Path = tmp_path_factory.mktemp("gone") / "kc"
    with start_sim(
        shipped_scenarios()["gpu-node-loss"], speed=10.0, serving=False, kubeconfig=kubeconfig
    ) as sim:

        class Where:
            kubeconfig = sim.kubeconfig
            kube_context = None

        yield kube_apis(Where())


def test_removing_the_router_label_from_a_gone_pod_is_done(ledger: EffectLedger, kube: KubeApis) -> None:
    deroute = PodMetadataPatch(kube, "inference", GONE, labels={ROUTER_LABEL: None})
    outcome = ledger.perform(
        "wf/deroute/gone", "k8s.pod.patch-metadata", f"pod/inference/{GONE}", {}, deroute
    )
    assert outcome.state == "applied", outcome
    assert outcome.result is not None and outcome.result["pod_gone"] is True


def test_setting_a_label_on_a_gone_pod_is_refused(ledger: EffectLedger, kube: KubeApis) -> None:
    route = PodMetadataPatch(kube, "inference", GONE, labels={ROUTER_LABEL: "true", "x": None})
    with pytest.raises(EffectFailed, match="no longer exists") as refused:
        ledger.perform("wf/route/gone", "k8s.pod.patch-metadata", f"pod/inference/{GONE}", {}, route)
    assert refused.value.outcome.state == "failed"


def test_a_gone_pod_is_not_ready_but_cannot_be_made_ready(ledger: EffectLedger, kube: KubeApis) -> None:
    not_ready = PodConditionPatch(kube, "inference", GONE, SERVING_READY_CONDITION, False, "draining")
    down = ledger.perform("wf/gate-down/gone", "k8s.pod.condition", f"pod/inference/{GONE}", {}, not_ready)
    assert down.state == "applied" and down.result is not None and down.result["pod_gone"] is True, down
    ready = PodConditionPatch(kube, "inference", GONE, SERVING_READY_CONDITION, True, "serving")
    with pytest.raises(EffectFailed, match="no longer exists"):
        ledger.perform("wf/gate-up/gone", "k8s.pod.condition", f"pod/inference/{GONE}", {}, ready)

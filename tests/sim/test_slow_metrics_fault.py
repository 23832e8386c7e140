"""The slow-metrics fault: an engine's API server too busy to answer its scrapes in time, still serving."""

from __future__ import annotations

import httpx
import pytest

from tests.sim.serving_fixtures import NAMESPACE, running_serving, scenario


async def test_slow_metrics_times_a_scrape_out_while_health_answers_and_clear_restores_it() -> None:
    async with running_serving(scenario(), speed=20) as sim:
        pod = (await sim.wait_serving(1))[0]
        url = sim.pod_url(pod)
        assert (await sim.fault("slow-metrics", f"{NAMESPACE}/{pod}", delay_s=30)).status_code == 202
        async with httpx.AsyncClient(timeout=httpx.Timeout(0.5, connect=2.0)) as scraper:
            with pytest.raises(httpx.ReadTimeout):
                await scraper.get(url + "/metrics")
            assert (await scraper.get(url + "/health")).status_code == 200  # present, not dead
            assert (await sim.fault("slow-metrics", f"{NAMESPACE}/{pod}", clear=True)).status_code == 202
            answered = await scraper.get(url + "/metrics")
        assert answered.status_code == 200 and "vllm:num_requests_waiting" in answered.text


async def test_slow_metrics_refuses_a_bad_delay() -> None:
    async with running_serving(scenario(), speed=20) as sim:
        pod = (await sim.wait_serving(1))[0]
        r = await sim.fault("slow-metrics", f"{NAMESPACE}/{pod}", delay_s=-1)
        assert r.status_code == 422 and "delay_s" in r.text, r.text

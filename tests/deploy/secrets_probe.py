"""A deliberately unlisted Kubernetes call, made the way fleetmend's activities make theirs (the
official client, on the worker's activity thread pool): lists the Secrets of the pool's namespace.
Nothing in fleetmend does this; the RBAC audit must refuse it. Sandbox-safe module."""

from __future__ import annotations

from datetime import timedelta

from temporalio import activity, workflow


@activity.defn(name="list_secrets")
def list_secrets(kubeconfig: str) -> int:
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=kubeconfig)
    try:
        listed = client.CoreV1Api(api).list_namespaced_secret("inference", _preload_content=False)
        return int(getattr(listed, "status", 200))
    except client.exceptions.ApiException as err:  # the sim may not serve Secrets: the call was made
        return int(err.status or 0)
    finally:
        api.close()


@workflow.defn(name="ReadSecrets")
class ReadSecrets:
    @workflow.run
    async def run(self, kubeconfig: str) -> int:
        return await workflow.execute_activity(
            list_secrets, kubeconfig, start_to_close_timeout=timedelta(seconds=30)
        )

"""The three PATCH content types the apiserver accepts.

* ``application/json-patch+json`` (RFC 6902) via the ``jsonpatch`` library;
* ``application/merge-patch+json`` (RFC 7386): ``null`` deletes, lists are replaced;
* ``application/strategic-merge-patch+json``: built-in types only; lists with a
  ``patchMergeKey`` (containers by ``name``, conditions by ``type``,
  ownerReferences by ``uid`` ...) merge element-wise and honour ``$patch: delete``
  and ``$patch: replace``; ``$setElementOrder``/``$retainKeys`` are accepted and ignored.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch

from sim.k8s.errors import ApiError, bad_request, unsupported_media_type

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

BUILTIN_PATCH_TYPES = [JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH, APPLY_PATCH]
CUSTOM_RESOURCE_PATCH_TYPES = [JSON_PATCH, MERGE_PATCH, APPLY_PATCH]

# Field name -> patchMergeKey for the core/apps/policy/discovery types the sim serves
# (from the ``patchMergeKey`` struct tags in k8s.io/api). Lists absent here are atomic.
MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "conditions": "type",
    "ownerReferences": "uid",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
    "readinessGates": "conditionType",
    "containerStatuses": "name",
    "initContainerStatuses": "name",
    "podIPs": "ip",
    "addresses": "type",
}
# Lists of scalars with patchStrategy=merge: union instead of replace.
MERGED_SCALAR_LISTS = frozenset({"finalizers"})


def json_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = json_merge_patch(result.get(key), value)
    return result


def _strategic_list(field: str, original: list[Any], patch: list[Any]) -> list[Any]:
    merge_key = MERGE_KEYS.get(field)
    if field in MERGED_SCALAR_LISTS:
        merged = list(original)
        merged.extend(item for item in patch if item not in merged)
        return merged
    if merge_key is None or not all(isinstance(item, dict) for item in patch):
        return [item for item in copy.deepcopy(patch) if not (isinstance(item, dict) and "$patch" in item)]
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [copy.deepcopy(item) for item in patch if item.get("$patch") != "replace"]
    result = [copy.deepcopy(item) for item in original]
    for item in patch:
        if merge_key not in item:
            raise bad_request(f"map: {item} does not contain declared merge key: {merge_key}")
        key_value = item[merge_key]
        index = next(
            (
                i
                for i, existing in enumerate(result)
                if isinstance(existing, dict) and existing.get(merge_key) == key_value
            ),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                result.pop(index)
            continue
        if index is None:
            result.append(strategic_merge_patch({}, item))
        else:
            result[index] = strategic_merge_patch(result[index], item)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Kubernetes strategic merge for the built-in types served here."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [v for v in result.get(field, []) if v not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and isinstance(result.get(key), list):
            result[key] = _strategic_list(key, result[key], value)
        elif isinstance(value, list):
            result[key] = _strategic_list(key, [], value)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = value
    return result


def normalise_content_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def apply_patch(
    obj: dict[str, Any], patch: Any, content_type: str | None, *, custom_resource: bool
) -> dict[str, Any]:
    """Apply ``patch`` to ``obj`` per the request's Content-Type; raises the apiserver's Status errors."""
    kind = normalise_content_type(content_type)
    accepted = CUSTOM_RESOURCE_PATCH_TYPES if custom_resource else BUILTIN_PATCH_TYPES
    if kind not in accepted:
        raise unsupported_media_type(accepted)
    if kind == APPLY_PATCH:
        raise ApiError(
            415,
            "UnsupportedMediaType",
            "server-side apply is not supported by the fleetmend simulator; use a merge or JSON patch",
        )
    if kind == JSON_PATCH:
        if not isinstance(patch, list):
            raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
        try:
            result = jsonpatch.apply_patch(obj, patch)
        except jsonpatch.JsonPatchTestFailed as exc:
            failed = next(
                (op.get("path") for op in patch if isinstance(op, dict) and op.get("op") == "test"), ""
            )
            raise ApiError(
                422,
                "Invalid",
                f"the server rejected our request due to an error in our request: testing value {failed} failed",
            ) from exc
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise ApiError(
                422, "Invalid", f"the server rejected our request due to an error in our request: {exc}"
            ) from exc
        if not isinstance(result, dict):
            raise bad_request("a JSON patch must leave an object")
        return result
    if not isinstance(patch, dict):
        raise bad_request("json: cannot unmarshal array into Go value of type map[string]interface {}")
    if kind == MERGE_PATCH:
        return json_merge_patch(obj, patch)
    merged = strategic_merge_patch(obj, patch)
    return merged if isinstance(merged, dict) else {}

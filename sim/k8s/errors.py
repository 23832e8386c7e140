"""Kubernetes ``Status`` errors, shaped exactly like the apiserver's.

The official client turns the HTTP code into its exception types
(``NotFoundException``, ``ConflictException``, plain ``ApiException`` for 429/5xx),
and callers read ``reason`` and ``details`` from the JSON body, so both must match.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An API failure that the server answers with a ``Status`` object."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = headers or {}

    def status(self) -> dict[str, Any]:
        """The ``Status`` body, its keys in the order the apiserver writes them (metav1.Status's fields:
        kind, apiVersion, metadata, status, message, reason, details, code): clients that compare an
        error's text, or print the raw body, see what a real server sends."""
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
        }
        if self.details is not None:
            body["details"] = self.details
        body["code"] = self.code
        return body


def _qualified(resource: str, group: str) -> str:
    return f"{resource}.{group}" if group else resource


def _details(name: str, resource: str, group: str) -> dict[str, Any]:
    details: dict[str, Any] = {"name": name, "kind": resource}
    if group:
        details["group"] = group
    return details


def not_found(resource: str, name: str, group: str = "") -> ApiError:
    return ApiError(
        404, "NotFound", f'{_qualified(resource, group)} "{name}" not found', _details(name, resource, group)
    )


def already_exists(resource: str, name: str, group: str = "") -> ApiError:
    return ApiError(
        409,
        "AlreadyExists",
        f'{_qualified(resource, group)} "{name}" already exists',
        _details(name, resource, group),
    )


def conflict(resource: str, name: str, group: str = "") -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {_qualified(resource, group)} "{name}": the object has been '
        "modified; please apply your changes to the latest version and try again",
        _details(name, resource, group),
    )


def invalid(kind: str, name: str, field: str, message: str, group: str = "", value: Any = None) -> ApiError:
    """422 Invalid with one FieldValueInvalid cause (``kind`` is the Kind, e.g. ``Pod``)."""
    shown = "" if value is None else f"Invalid value: {value!r}: "
    cause_message = f"{shown}{message}"
    qualified = f"{kind}.{group}" if group else kind
    details = {
        "name": name,
        "kind": kind,
        "causes": [{"reason": "FieldValueInvalid", "message": cause_message, "field": field}],
    }
    if group:
        details["group"] = group
    return ApiError(422, "Invalid", f'{qualified} "{name}" is invalid: {field}: {cause_message}', details)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def unsupported_media_type(accepted: list[str]) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        "the body of the request was in an unknown format - accepted media types include: "
        + ", ".join(accepted),
    )


def method_not_allowed(message: str) -> ApiError:
    return ApiError(405, "MethodNotAllowed", message)


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized")


def forbidden(user: str, verb: str, resource: str, name: str, namespace: str, group: str = "") -> ApiError:
    """What RBAC answers: ``User "u" cannot patch resource "pods" in API group "" in the namespace "ns"``."""
    where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
    message = (
        f'{resource} "{name}" is forbidden: User "{user}" cannot {verb} resource "{resource}" '
        f'in API group "{group}"{where}'
    )
    return ApiError(403, "Forbidden", message, _details(name, resource, group))


def too_many_requests(
    message: str, causes: list[dict[str, str]] | None = None, retry_after: int = 0
) -> ApiError:
    details: dict[str, Any] = {}
    if causes:
        details["causes"] = causes
    headers: dict[str, str] = {}
    if retry_after > 0:
        details["retryAfterSeconds"] = retry_after
        headers["Retry-After"] = str(retry_after)
    return ApiError(429, "TooManyRequests", message, details or None, headers)


def internal_error(message: str) -> ApiError:
    return ApiError(
        500, "InternalError", f"Internal error occurred: {message}", {"causes": [{"message": message}]}
    )


def timeout(message: str) -> ApiError:
    return ApiError(504, "Timeout", message, {})

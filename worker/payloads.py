"""How fleetmend's Temporal payloads read across two releases at once (a rolling upgrade).

fleetmend's models forbid unknown fields, so a typo in configuration or in an HTTP body is an error that
names the field. Between workers that rule is wrong. During a rolling upgrade the newer release's fast
path signals a ``LossReport`` carrying a field the older release does not know (``arrivals_before`` was
one) to an incident that the older release runs: Worker Deployment Versioning pins the workflow to its
release, not the process that signals it. Refused, the payload fails the workflow task on every retry and
the incident stops moving. So a payload Temporal hands this release is read the way protobuf reads one:
a field this release does not know is dropped, and logged with its path; every other validation error
stands. The other direction is kept by a rule on the models: a field a release adds has a default, so a
payload of an older release reads in a newer one.

Everything else is temporalio's pydantic converter (``temporalio.contrib.pydantic``), which this extends.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import temporalio.api.common.v1
from pydantic import ValidationError
from temporalio.contrib.pydantic import PydanticJSONPlainPayloadConverter
from temporalio.converter import (
    CompositePayloadConverter,
    DataConverter,
    DefaultPayloadConverter,
    JSONPlainPayloadConverter,
)

log = logging.getLogger("fleetmend.payloads")

Path = tuple[int | str, ...]


def unknown_field_paths(error: ValidationError) -> list[Path] | None:
    """Where a newer release's fields are, when those are the error's only complaints (else None)."""
    errors = error.errors()
    paths = [tuple(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    return paths if paths and len(paths) == len(errors) else None


def without(data: Any, paths: list[Path]) -> Any | None:
    """``data`` (parsed JSON) with the fields at ``paths`` removed; None when a path does not lead to one
    (a union member's name in the path, say): then the caller keeps the original error."""
    for path in paths:
        parent = data
        for step in path[:-1]:
            if isinstance(parent, dict) and isinstance(step, str) and step in parent:
                parent = parent[step]
            elif isinstance(parent, list) and isinstance(step, int) and 0 <= step < len(parent):
                parent = parent[step]
            else:
                return None
        if not isinstance(parent, dict) or path[-1] not in parent:
            return None
        del parent[path[-1]]
    return data


class ReleaseTolerantJSONConverter(PydanticJSONPlainPayloadConverter):
    """temporalio's pydantic JSON converter that drops the fields of a newer release (module docstring)."""

    def from_payload(self, payload: temporalio.api.common.v1.Payload, type_hint: type | None = None) -> Any:
        try:
            return super().from_payload(payload, type_hint)
        except ValidationError as error:
            paths = unknown_field_paths(error)
            data = without(json.loads(payload.data), paths) if paths else None
            if paths is None or data is None:
                raise
            log.warning(
                "ignored field(s) this release does not know (sent by a newer release?): %s",
                ", ".join(".".join(str(step) for step in path) for path in paths),
            )
            trimmed = temporalio.api.common.v1.Payload(
                metadata=payload.metadata, data=json.dumps(data).encode()
            )
            return super().from_payload(trimmed, type_hint)


class ReleaseTolerantPayloadConverter(CompositePayloadConverter):
    """temporalio's default payload converters, JSON read by ``ReleaseTolerantJSONConverter``."""

    def __init__(self) -> None:
        json_converter = ReleaseTolerantJSONConverter()
        super().__init__(
            *(
                json_converter if isinstance(c, JSONPlainPayloadConverter) else c
                for c in DefaultPayloadConverter.default_encoding_payload_converters
            )
        )


data_converter = DataConverter(payload_converter_class=ReleaseTolerantPayloadConverter)
"""The data converter every fleetmend client and worker uses."""

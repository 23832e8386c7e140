"""Canonical JSON and fingerprints: two requests are "the same" when these bytes match."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from ledger.errors import InvalidEffectRequest


def to_json_object(value: Mapping[str, Any] | BaseModel, what: str) -> dict[str, Any]:
    """A plain JSON object (dict) from a mapping or pydantic model, or a clear error."""
    return canonical_object(value, what)[0]


def canonical_object(value: Mapping[str, Any] | BaseModel, what: str) -> tuple[dict[str, Any], str]:
    """The JSON object and its canonical text (sorted keys, no spaces), or a clear error."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if not isinstance(value, Mapping):
        raise InvalidEffectRequest(f"{what} must be a JSON object (a dict), got {type(value).__name__}")
    try:
        text = canonical_json(dict(value))
    except (TypeError, ValueError) as exc:
        raise InvalidEffectRequest(
            f"{what} must be JSON-serialisable (no NaN, no custom objects): {exc}"
        ) from exc
    return json.loads(text), text


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def fingerprint(kind: str, target: str, params: Mapping[str, Any]) -> str:
    """sha256 over kind, target and canonical params: what "same request" means for an operation id."""
    return fingerprint_of_canonical(kind, target, canonical_json(params))


def fingerprint_of_canonical(kind: str, target: str, params_json: str) -> str:
    """:func:`fingerprint` from already canonical params text: the canonical JSON of
    ``{"kind", "params", "target"}`` (keys in sorted order) without re-serialising the params."""
    payload = f'{{"kind":{canonical_json(kind)},"params":{params_json},"target":{canonical_json(target)}}}'
    return hashlib.sha256(payload.encode()).hexdigest()


def body_digest(body: bytes) -> str:
    """The digest an action log records for a request body: ``sha256:`` + hex of the raw bytes sent
    (the sim's ``ActionLogEntry.body_digest`` format)."""
    return "sha256:" + hashlib.sha256(body).hexdigest()

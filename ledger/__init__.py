"""The effect ledger: every external action fleetmend takes, performed at most once per operation id.

Entry point: :class:`EffectLedger` and its :meth:`~EffectLedger.perform`. See
``ledger/store.py`` for the protocol and ``ledger/effect.py`` for what an effect kind
implements.
"""

from ledger.canonical import body_digest, fingerprint
from ledger.effect import ActionSignature, Attempt, CallableEffect, Effect, EffectContext
from ledger.errors import (
    DivergentOperation,
    EffectAttemptError,
    EffectFailed,
    FencedOut,
    InvalidEffectRequest,
    LedgerUnavailable,
    NeedsOperator,
    NonRetryableLedgerError,
    OperationInProgress,
    PermanentEffectError,
    RetryableLedgerError,
)
from ledger.models import Delivery, EffectState
from ledger.outcome import DivergenceView, EffectOutcome
from ledger.store import EffectLedger, make_engine, open_ledger

__all__ = [
    "ActionSignature",
    "Attempt",
    "CallableEffect",
    "Delivery",
    "DivergenceView",
    "DivergentOperation",
    "Effect",
    "EffectAttemptError",
    "EffectContext",
    "EffectFailed",
    "EffectLedger",
    "EffectOutcome",
    "EffectState",
    "FencedOut",
    "InvalidEffectRequest",
    "LedgerUnavailable",
    "NeedsOperator",
    "NonRetryableLedgerError",
    "OperationInProgress",
    "PermanentEffectError",
    "RetryableLedgerError",
    "body_digest",
    "fingerprint",
    "make_engine",
    "open_ledger",
]

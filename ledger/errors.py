"""What ``perform`` raises, split by what the caller (a Temporal activity) should do next.

Retryable errors are plain exceptions: Temporal retries the activity, and the next
attempt resolves the operation safely (reads the stored outcome, or probes the
target). Non-retryable errors are ``ApplicationError(non_retryable=True)`` so an
activity can let them propagate and Temporal stops retrying without extra glue;
their details carry the recorded outcome as JSON.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from temporalio.exceptions import ApplicationError

if TYPE_CHECKING:
    from ledger.outcome import EffectOutcome


class InvalidEffectRequest(ValueError):
    """The request itself is malformed (bad op id, params not JSON, effect without a probe...). Nothing was recorded."""


class PermanentEffectError(Exception):
    """Raised by an effect's ``apply`` when the target refused for good (e.g. a 4xx that retrying cannot fix).

    The ledger records the operation as ``failed`` with this message and raises :class:`EffectFailed`.
    """


class RetryableLedgerError(Exception):
    """Transient: retry the whole ``perform`` with the same operation id."""


class OperationInProgress(RetryableLedgerError):
    """Another worker holds a live lease on this operation and did not finish within the wait."""


class FencedOut(RetryableLedgerError):
    """This attempt lost its lease (paused or partitioned past its expiry); another attempt owns the operation now.

    Nothing this attempt observed was recorded. The retry returns whatever the new owner recorded.
    """


class EffectAttemptError(RetryableLedgerError):
    """``apply`` or ``probe`` raised a transient error; the outcome is unknown until the next attempt probes."""


class LedgerUnavailable(RetryableLedgerError):
    """The ledger database could not be reached or lost the connection mid-transaction."""


class NonRetryableLedgerError(ApplicationError):
    """The operation is resolved in a way a retry cannot change. ``outcome`` is what the ledger holds."""

    def __init__(self, message: str, outcome: EffectOutcome) -> None:
        details: dict[str, Any] = outcome.model_dump(mode="json")
        super().__init__(message, details, type=type(self).__name__, non_retryable=True)
        self.outcome = outcome


class EffectFailed(NonRetryableLedgerError):
    """The target refused the effect for good; recorded as ``failed`` with the error."""


class DivergentOperation(NonRetryableLedgerError):
    """The operation id was already used with different kind/target/params; never applied, recorded, reported.

    ``outcome`` is the *original* operation's outcome.
    """


class NeedsOperator(NonRetryableLedgerError):
    """An earlier attempt's outcome is unknown and this kind can neither probe nor safely repeat."""

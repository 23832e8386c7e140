"""The gateway policy's own checks: bad input is a clear error before anything reaches Envoy."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fleet.gateway import Admission
from fleet.vocabulary import Tier


def test_a_partial_shed_share_must_lie_strictly_between_0_and_1() -> None:
    for share in (0.0, 1.0, 1.5):
        with pytest.raises(ValidationError, match="strictly between 0 and 1"):
            Admission(partial_shed={Tier.STANDARD: share})
    admission = Admission(shed_tiers=[Tier.SHEDDABLE], partial_shed={Tier.STANDARD: 0.25})
    assert admission.shed_share(Tier.SHEDDABLE) == 1.0
    assert admission.shed_share(Tier.STANDARD) == 0.25
    assert admission.shed_share(Tier.CRITICAL) == 0.0

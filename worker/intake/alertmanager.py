"""The Alertmanager webhook payload (version 4), as Alertmanager sends it.

Field names and shapes follow Alertmanager's ``template.Data`` / ``template.Alert``
(``notify/webhook/webhook.go``). Unknown keys are ignored so newer Alertmanager
releases (``notification_reason``, ``routeLabels``, ...) and older ones (classic
fields only) both parse; the fields fleetmend acts on are validated strictly.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from fleet.incident import AlertStatus

SUPPORTED_VERSION = "4"

# Alertmanager zeroes endsAt while an alert fires ("0001-01-01T00:00:00Z").
_GO_ZERO_TIME = datetime(1, 1, 1, tzinfo=UTC)

LabelName = Annotated[str, StringConstraints(min_length=1, max_length=256)]
LabelValue = Annotated[str, StringConstraints(max_length=4096)]
Labels = dict[LabelName, LabelValue]


class AlertmanagerAlert(BaseModel):
    """One alert of a notification (``template.Alert``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    status: AlertStatus
    labels: Labels
    annotations: Labels = Field(default_factory=dict)
    starts_at: datetime = Field(alias="startsAt")
    ends_at: datetime | None = Field(None, alias="endsAt")
    generator_url: str = Field("", alias="generatorURL", max_length=8192)
    # model.Fingerprint prints as 16 hex digits; hand-written payloads may use any short token.
    fingerprint: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:-]+$")

    @property
    def name(self) -> str:
        return self.labels.get("alertname", "")

    @property
    def ended(self) -> datetime | None:
        """``endsAt`` if Alertmanager exposed one (it zeroes it while the alert fires)."""
        if self.ends_at is None or self.ends_at <= _GO_ZERO_TIME:
            return None
        return self.ends_at


class AlertmanagerPayload(BaseModel):
    """One webhook notification: a group of alerts (``template.Data`` + version/groupKey)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    version: str = Field(description="Payload version; fleetmend accepts '4'")
    group_key: str = Field("", alias="groupKey", max_length=8192)
    truncated_alerts: int = Field(0, alias="truncatedAlerts", ge=0)
    status: AlertStatus
    receiver: str = Field(max_length=1024)
    group_labels: Labels = Field(default_factory=dict, alias="groupLabels")
    common_labels: Labels = Field(default_factory=dict, alias="commonLabels")
    common_annotations: Labels = Field(default_factory=dict, alias="commonAnnotations")
    external_url: str = Field("", alias="externalURL", max_length=8192)
    alerts: list[AlertmanagerAlert]

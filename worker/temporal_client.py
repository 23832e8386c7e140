"""How every fleetmend process connects to Temporal.

One place decides the data converter (pydantic v2, so workflow inputs, results,
queries and updates are validated models), the namespace and the transport
security, so the worker, the webhook API and the CLI always agree with each other.

Transport settings follow the SDK's environment configuration (``temporalio.envconfig``),
which the ``temporal`` CLI reads too:

* a TOML profile (``TEMPORAL_CONFIG_FILE``, default ``~/.config/temporalio/temporal.toml``;
  ``TEMPORAL_PROFILE``, default ``default``) is the base when present;
* ``TEMPORAL_ADDRESS`` / ``TEMPORAL_NAMESPACE`` / ``TEMPORAL_API_KEY`` / ``TEMPORAL_TLS`` /
  ``TEMPORAL_TLS_SERVER_CA_CERT_PATH`` / ``TEMPORAL_TLS_CLIENT_CERT_PATH`` /
  ``TEMPORAL_TLS_CLIENT_KEY_PATH`` / ``TEMPORAL_TLS_SERVER_NAME`` override it (each also as
  ``FLEETMEND_TEMPORAL_*``, see ``worker.config``).

Certificate files are read and checked before connecting, so a missing key, a key that
does not match its certificate or a file that is not PEM fails at start-up with one
line naming the setting, not with a handshake error deep in the SDK.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.envconfig import ClientConfigProfile
from temporalio.runtime import Runtime
from temporalio.service import RPCError, RPCStatusCode, TLSConfig

from worker.config import Settings
from worker.payloads import data_converter
from worker.priorities import ClientPriorities

DEFAULT_CONFIG_FILE = Path("~/.config/temporalio/temporal.toml")

# The documented variable of each Settings field, for error messages.
SETTING_NAMES = {
    "temporal_address": "TEMPORAL_ADDRESS",
    "temporal_namespace": "TEMPORAL_NAMESPACE",
    "temporal_api_key": "TEMPORAL_API_KEY",
    "temporal_tls": "TEMPORAL_TLS",
    "temporal_tls_server_ca_cert_path": "TEMPORAL_TLS_SERVER_CA_CERT_PATH",
    "temporal_tls_client_cert_path": "TEMPORAL_TLS_CLIENT_CERT_PATH",
    "temporal_tls_client_key_path": "TEMPORAL_TLS_CLIENT_KEY_PATH",
    "temporal_tls_server_name": "TEMPORAL_TLS_SERVER_NAME",
    "temporal_config_file": "TEMPORAL_CONFIG_FILE",
}


class TemporalSettingError(ValueError):
    """A Temporal connection setting is unusable; the message names it and says what to do."""


@dataclass(frozen=True)
class TemporalConnection:
    """The effective connection: what ``Client.connect`` gets, and where each part came from."""

    address: str
    namespace: str
    tls: TLSConfig | None
    api_key: str | None = field(default=None, repr=False)
    rpc_metadata: dict[str, str] = field(default_factory=dict)
    server_ca_cert_path: Path | None = None
    client_cert_path: Path | None = None
    client_key_path: Path | None = None
    server_name: str | None = None
    profile_file: Path | None = None

    def describe(self) -> str:
        """One line for logs and error messages: address, namespace and security, no secrets."""
        if self.tls is None:
            security = "plaintext"
        else:
            parts = [f"CA {self.server_ca_cert_path}" if self.server_ca_cert_path else "system CAs"]
            if self.client_cert_path:
                parts.append(f"client cert {self.client_cert_path}")
            if self.server_name:
                parts.append(f"server name {self.server_name}")
            security = "TLS (" + ", ".join(parts) + ")"
        if self.api_key:
            security += " + API key"
        return f"{self.address} namespace {self.namespace}, {security}"

    def masked(self) -> dict[str, str | None]:
        """The settings as ``fleetmend config`` shows them: the API key masked."""
        return {
            "TEMPORAL_ADDRESS": self.address,
            "TEMPORAL_NAMESPACE": self.namespace,
            "TEMPORAL_TLS": "true" if self.tls is not None else "false",
            "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(self.server_ca_cert_path or "") or None,
            "TEMPORAL_TLS_CLIENT_CERT_PATH": str(self.client_cert_path or "") or None,
            "TEMPORAL_TLS_CLIENT_KEY_PATH": str(self.client_key_path or "") or None,
            "TEMPORAL_TLS_SERVER_NAME": self.server_name,
            "TEMPORAL_API_KEY": "********" if self.api_key else None,
            "TEMPORAL_CONFIG_FILE": str(self.profile_file) if self.profile_file else None,
        }


def _profile(settings: Settings) -> tuple[ClientConfigProfile | None, Path | None]:
    """The TOML profile, when a config file is named or the default one exists (environment not applied:
    ``Settings`` already read the variables)."""
    named = settings.temporal_config_file
    path = (named or DEFAULT_CONFIG_FILE).expanduser()
    if not path.is_file():
        if named is not None:
            raise TemporalSettingError(
                f"TEMPORAL_CONFIG_FILE={named}: no such file; point it at the Temporal TOML client config "
                "or unset it"
            )
        return None, None
    try:
        profile = ClientConfigProfile.load(
            profile=settings.temporal_profile, config_source=path, disable_env=True
        )
    except Exception as err:
        raise TemporalSettingError(
            f"TEMPORAL_CONFIG_FILE={path}: cannot use profile {settings.temporal_profile or 'default'!r} "
            f"({err}); fix the file or set TEMPORAL_PROFILE to one of its profiles"
        ) from err
    return profile, path


def _read_pem(setting: str, path: Path, what: str) -> bytes:
    try:
        data = path.expanduser().read_bytes()
    except OSError as err:
        raise TemporalSettingError(
            f"{setting}={path}: cannot read the {what} ({err.strerror or err}); mount it there or fix the path"
        ) from err
    if b"-----BEGIN" not in data:
        raise TemporalSettingError(f"{setting}={path}: not a PEM file; it must hold the {what} in PEM form")
    return data


def _check_ca(path: Path) -> None:
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    try:
        context.load_verify_locations(cafile=str(path.expanduser()))
    except ssl.SSLError as err:
        raise TemporalSettingError(
            f"TEMPORAL_TLS_SERVER_CA_CERT_PATH={path}: not a usable CA certificate ({err.reason or err})"
        ) from err


def _check_key_pair(cert: Path, key: Path) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(certfile=str(cert.expanduser()), keyfile=str(key.expanduser()))
    except ssl.SSLError as err:
        raise TemporalSettingError(
            f"TEMPORAL_TLS_CLIENT_KEY_PATH={key}: not the private key of TEMPORAL_TLS_CLIENT_CERT_PATH={cert} "
            f"({err.reason or err}); mount the key that belongs to that certificate"
        ) from err


def connection(settings: Settings) -> TemporalConnection:
    """Resolve the effective connection from ``settings`` over the TOML profile; check the TLS files."""
    profile, profile_file = _profile(settings)
    given = settings.model_fields_set
    ptls = profile.tls if profile is not None else None

    def pick(name: str, from_profile: object) -> object:
        value = getattr(settings, name)
        return value if name in given or from_profile is None else from_profile

    def path_of(source: object) -> Path | None:
        return source if isinstance(source, Path) else None

    address = str(pick("temporal_address", profile.address if profile else None))
    namespace = str(pick("temporal_namespace", profile.namespace if profile else None))
    api_key_value = settings.temporal_api_key.get_secret_value() if settings.temporal_api_key else None
    api_key = api_key_value or (profile.api_key if profile else None) or None
    ca = settings.temporal_tls_server_ca_cert_path or path_of(ptls.server_root_ca_cert if ptls else None)
    cert = settings.temporal_tls_client_cert_path or path_of(ptls.client_cert if ptls else None)
    key = settings.temporal_tls_client_key_path or path_of(ptls.client_private_key if ptls else None)
    server_name = settings.temporal_tls_server_name or (ptls.server_name if ptls else None)
    tls_on = settings.temporal_tls
    if tls_on is None and ptls is not None and ptls.disabled is not None:
        tls_on = not ptls.disabled
    wants_tls = bool(ca or cert or key or server_name or api_key)
    if tls_on is False and (ca or cert or key):
        raise TemporalSettingError(
            "TEMPORAL_TLS=false but TLS files are set (TEMPORAL_TLS_SERVER_CA_CERT_PATH / "
            "TEMPORAL_TLS_CLIENT_CERT_PATH / TEMPORAL_TLS_CLIENT_KEY_PATH): unset TEMPORAL_TLS or the files"
        )
    if cert and not key:
        raise TemporalSettingError(
            f"TEMPORAL_TLS_CLIENT_KEY_PATH is not set but TEMPORAL_TLS_CLIENT_CERT_PATH={cert} is: mTLS needs "
            "the client certificate's private key; mount it and set TEMPORAL_TLS_CLIENT_KEY_PATH"
        )
    if key and not cert:
        raise TemporalSettingError(
            f"TEMPORAL_TLS_CLIENT_CERT_PATH is not set but TEMPORAL_TLS_CLIENT_KEY_PATH={key} is: mTLS needs "
            "the client certificate too; set TEMPORAL_TLS_CLIENT_CERT_PATH"
        )
    tls: TLSConfig | None = None
    if tls_on or (tls_on is None and wants_tls):
        ca_pem = _read_pem("TEMPORAL_TLS_SERVER_CA_CERT_PATH", ca, "CA certificate") if ca else None
        if ca:
            _check_ca(ca)
        cert_pem = _read_pem("TEMPORAL_TLS_CLIENT_CERT_PATH", cert, "client certificate") if cert else None
        key_pem = _read_pem("TEMPORAL_TLS_CLIENT_KEY_PATH", key, "client private key") if key else None
        if cert and key:
            _check_key_pair(cert, key)
        tls = TLSConfig(
            server_root_ca_cert=ca_pem, client_cert=cert_pem, client_private_key=key_pem, domain=server_name
        )
    return TemporalConnection(
        address=address,
        namespace=namespace,
        tls=tls,
        api_key=api_key,
        rpc_metadata=dict(profile.grpc_meta) if profile else {},
        server_ca_cert_path=ca,
        client_cert_path=cert,
        client_key_path=key,
        server_name=server_name,
        profile_file=profile_file,
    )


def probe_wants_client_certificate(conn: TemporalConnection, timeout_s: float = 3.0) -> bool:
    """Whether the frontend, dialled with the configured CA and no client certificate, completes the
    handshake and then refuses for want of one (TLS 1.3 alert ``certificate_required``, or a close).

    The SDK's own error text for this case depends on timing (rustls reports an unexpected EOF, a
    broken pipe or a reset); one handshake of our own makes the diagnosis deterministic. Only called
    after a failed connect, so it never delays a healthy start.
    """
    host, _, port = conn.address.rpartition(":")
    context = ssl.create_default_context(
        cafile=str(conn.server_ca_cert_path) if conn.server_ca_cert_path else None
    )
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as raw:
            with context.wrap_socket(raw, server_hostname=conn.server_name or host) as tls:
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                return tls.recv(1) == b""
    except ssl.SSLError as err:
        return "CERTIFICATE_REQUIRED" in str(err).upper() or "HANDSHAKE_FAILURE" in str(err).upper()
    except (OSError, ValueError):
        return False


def handshake_hint(conn: TemporalConnection, error: BaseException) -> str | None:
    """The setting to fix when a connect error is a TLS failure, else None."""
    text = str(error).lower()
    if conn.tls is None:
        if "connection reset" in text or "broken pipe" in text or "frame" in text:
            return (
                "the frontend may require TLS: set TEMPORAL_TLS=true (and TEMPORAL_TLS_SERVER_CA_CERT_PATH "
                "for a private CA)"
            )
        return None
    if any(
        s in text
        for s in ("unknownissuer", "unknown issuer", "certificate verify", "invalid peer certificate")
    ):
        if "notvalidforname" in text or "not valid for name" in text:
            return (
                "the frontend's certificate does not carry the name dialled: set TEMPORAL_TLS_SERVER_NAME "
                "to the name it carries"
            )
        return (
            f"the frontend's certificate is not signed by TEMPORAL_TLS_SERVER_CA_CERT_PATH="
            f"{conn.server_ca_cert_path or '(system CAs)'}: point it at the CA that signed it"
        )
    if "notvalidforname" in text or "not valid for name" in text:
        return "the frontend's certificate does not carry the name dialled: set TEMPORAL_TLS_SERVER_NAME"
    dropped = (
        "connection closed", "connectionreset", "connection reset", "unexpectedeof", "close_notify",
        "broken pipe", "brokenpipe",
    )  # fmt: skip
    if conn.client_cert_path is None and (
        "certificate required" in text
        or ("after connection" in text and any(s in text for s in dropped))
        or probe_wants_client_certificate(conn)
    ):
        # TLS 1.3: a server that wants a client certificate drops the connection after the handshake.
        return (
            "the frontend dropped the connection right after the TLS handshake, as an mTLS frontend does "
            "without a client certificate: set TEMPORAL_TLS_CLIENT_CERT_PATH and TEMPORAL_TLS_CLIENT_KEY_PATH"
        )
    if "certificate required" in text or "handshake" in text or "alert" in text:
        return (
            "the frontend refused the TLS handshake: it may require a client certificate "
            "(TEMPORAL_TLS_CLIENT_CERT_PATH / TEMPORAL_TLS_CLIENT_KEY_PATH) signed by a CA it trusts"
        )
    return None


async def connect(
    settings: Settings, *, runtime: Runtime | None = None, identity: str | None = None
) -> Client:
    """Connect to the configured frontend and namespace (TLS / API key as configured).

    Raises ``TemporalSettingError`` when a TLS setting is unusable, ``RuntimeError`` (from the SDK)
    when the server cannot be reached; callers that need a friendlier message use
    ``worker.startup_checks``.
    """
    conn = connection(settings)
    return await Client.connect(
        conn.address,
        namespace=conn.namespace,
        data_converter=data_converter,
        runtime=runtime,
        identity=identity,
        tls=conn.tls if conn.tls is not None else False,
        api_key=conn.api_key,
        rpc_metadata=conn.rpc_metadata,
        interceptors=[ClientPriorities()],
    )


# An Update the server turned away because the workflow task meant to carry it failed.
UPDATE_NOT_READY = "unexpected workflow task failure"


async def execute_update(
    handle: WorkflowHandle[Any, Any],
    update: Any,
    arg: Any,
    *,
    tries: int = 5,
    pause_s: float = 1.0,
    **kw: Any,
) -> Any:
    """Send an Update (an operator's answer, a reset) and wait for its result, sending it again while
    the server says the workflow is not ready for it.

    The server refuses an Update with FAILED_PRECONDITION ("... due to unexpected workflow task
    failure", a WorkflowNotReadyFailure) when the workflow task that was to carry it failed: its worker
    was too slow to answer before the task timed out, or restarted. Since Temporal 1.27 the client's
    own retries stop at that answer (temporalio/temporal#7296), so that a workflow whose tasks keep
    failing answers at once. The Update was never accepted, so sending it again cannot apply it twice;
    a worker that was only slow carries the next one. After ``tries`` the error goes to the caller.
    ``kw`` goes to ``execute_update`` (``result_type``, ``id``).
    """
    for attempt in range(1, tries + 1):
        try:
            return await handle.execute_update(update, arg, **kw)
        except RPCError as err:
            not_ready = err.status == RPCStatusCode.FAILED_PRECONDITION and UPDATE_NOT_READY in err.message
            if not not_ready or attempt == tries:
                raise
            await asyncio.sleep(pause_s * attempt)
    raise AssertionError("unreachable")

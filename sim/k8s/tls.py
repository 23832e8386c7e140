"""The simulated API server's TLS: a cluster CA generated at start and a serving certificate it signs.

Like a kubeadm cluster: ``ca.crt`` (self-signed, ``CA:TRUE``) goes into the kubeconfig as
``certificate-authority-data``; the serving certificate names ``127.0.0.1``, ``localhost`` and
``kubernetes`` / ``kubernetes.default.svc`` as subject alternative names, so kubectl, client-go
and the Python client verify the server without ``insecure-skip-tls-verify``. Keys are ECDSA P-256
(fast to generate: the sim starts many times per test run) and never leave the sim's directory.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVING_DNS_NAMES = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc")
SERVING_IPS = ("127.0.0.1",)


@dataclass(frozen=True)
class ServingCerts:
    """PEM files of one sim start: the CA (for clients) and the server's certificate chain and key."""

    ca_cert: Path
    server_cert: Path
    server_key: Path

    def ca_pem(self) -> bytes:
        return self.ca_cert.read_bytes()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def generate_serving_certs(
    directory: Path, *, extra_ips: tuple[str, ...] = (), extra_names: tuple[str, ...] = ()
) -> ServingCerts:
    """Write ``ca.crt``, ``apiserver.crt`` and ``apiserver.key`` (mode 0600) under ``directory``.

    ``extra_names`` / ``extra_ips``: more subject alternative names (like kubeadm's certSANs).
    """
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("fleetmend-sim-ca")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alt_names: list[x509.GeneralName] = [x509.DNSName(n) for n in (*SERVING_DNS_NAMES, *extra_names)]
    alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in (*SERVING_IPS, *extra_ips)]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("kube-apiserver"))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    certs = ServingCerts(directory / "ca.crt", directory / "apiserver.crt", directory / "apiserver.key")
    certs.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    certs.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    certs.server_key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    certs.server_key.chmod(0o600)
    return certs

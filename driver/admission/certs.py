"""The webhook's own certificates (self-managed mode): a CA and a serving certificate it signs, kept
in one Secret, checked and renewed before they expire. Pure functions of PEM bytes and a clock; the
Secret and the webhook configuration are driver/admission/rotation.py's.

The Secret's data: `ca.crt` the trusted CAs (the signing CA first, then older CAs still valid: the
webhook configuration's caBundle, so a certificate of either is trusted while a new CA takes over),
`ca.key` the signing CA's key, `tls.crt` and `tls.key` the serving certificate and its key.
Keys are ECDSA P-256: quick to make, accepted by kube-apiserver (Go's crypto/tls).
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from driver.admission.lifetimes import Lifetimes

# A certificate is valid from a little before it is made: a node whose clock is behind still takes it.
BACKDATE = datetime.timedelta(minutes=5)
SECRET_KEYS = ("ca.crt", "ca.key", "tls.crt", "tls.key")


def service_hosts(service: str, namespace: str, extra: Sequence[str] = ()) -> tuple[str, ...]:
    """The names kube-apiserver may check the certificate against: the Service's (it dials
    `<service>.<namespace>.svc`), then any extra DNS names or IP addresses (a URL-configured webhook)."""
    names = (service, f"{service}.{namespace}", f"{service}.{namespace}.svc") if service else ()
    return tuple(dict.fromkeys((*names, *extra)))


@dataclass(frozen=True)
class Bundle:
    """PEM bytes of the CAs (caBundle; the signing CA first), the signing CA's key, the serving
    certificate and its key."""

    ca_bundle: bytes
    ca_key: bytes
    cert: bytes
    key: bytes

    def secret_data(self) -> dict[str, bytes]:
        return dict(zip(SECRET_KEYS, (self.ca_bundle, self.ca_key, self.cert, self.key), strict=True))

    @classmethod
    def from_secret_data(cls, data: dict[str, bytes]) -> Bundle | None:
        """The bundle a Secret holds; None when a key is missing (e.g. a Secret another tool made)."""
        if not all(data.get(key) for key in SECRET_KEYS):
            return None
        return cls(*(data[key] for key in SECRET_KEYS))

    def serving_not_after(self) -> datetime.datetime:
        return x509.load_pem_x509_certificate(self.cert).not_valid_after_utc


def _now(now: datetime.datetime | None) -> datetime.datetime:
    return now or datetime.datetime.now(datetime.UTC)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    pkcs8 = serialization.PrivateFormat.PKCS8
    return key.private_bytes(serialization.Encoding.PEM, pkcs8, serialization.NoEncryption())


_USAGES = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
           "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")  # fmt: skip


def _key_usage(*allowed: str) -> x509.KeyUsage:
    return x509.KeyUsage(**{usage: usage in allowed for usage in _USAGES})


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])


def new_ca(common_name: str, validity_s: float, now: datetime.datetime | None = None) -> tuple[bytes, bytes]:
    """(certificate, key) of a CA that signs serving certificates only (path length 0)."""
    now = _now(now)
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + datetime.timedelta(seconds=validity_s))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage("digital_signature", "key_cert_sign", "crl_sign"), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def new_serving(
    ca_cert: bytes, ca_key: bytes, hosts: Sequence[str], validity_s: float, now: datetime.datetime | None = None
) -> tuple[bytes, bytes]:
    """(certificate, key) for `hosts`, signed by the CA, valid `validity_s` (never past the CA)."""
    now = _now(now)
    issuer = x509.load_pem_x509_certificate(ca_cert)
    signer = serialization.load_pem_private_key(ca_key, password=None)
    assert isinstance(signer, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    not_after = min(now + datetime.timedelta(seconds=validity_s), issuer.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[-1] if hosts else "fgpu-webhook"))
        .issuer_name(issuer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage("digital_signature"), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), critical=False)
        .sign(signer, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def _split_pem(bundle: bytes) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(bundle)


def renewal_reason(
    bundle: Bundle, hosts: Sequence[str], lifetimes: Lifetimes, now: datetime.datetime | None = None
) -> str | None:
    """Why `bundle` must be replaced now, or None while it serves: unreadable, not for these
    hosts, not the signing CA's, its key not its own, or too close to its expiry (or its CA's)."""
    now = _now(now)
    try:
        cas = _split_pem(bundle.ca_bundle)
        ca_key = serialization.load_pem_private_key(bundle.ca_key, password=None)
        cert = x509.load_pem_x509_certificate(bundle.cert)
        key = serialization.load_pem_private_key(bundle.key, password=None)
    except ValueError as err:
        return f"unreadable ({err})"
    signing = cas[0]
    if ca_key.public_key() != signing.public_key():
        return "ca.key is not the key of the first certificate in ca.crt"
    if key.public_key() != cert.public_key():
        return "tls.key is not the key of tls.crt"
    try:
        cert.verify_directly_issued_by(signing)
    except (ValueError, TypeError, InvalidSignature):
        return "tls.crt is not signed by the CA"
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "tls.crt names no hosts"
    if set(_san(hosts)) - set(names):
        return f"tls.crt is not for {', '.join(hosts)}"
    left = cert.not_valid_after_utc - now
    if left.total_seconds() <= lifetimes.renew_before_s:
        return f"tls.crt expires at {cert.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}"
    if (signing.not_valid_after_utc - now).total_seconds() <= lifetimes.validity_s + lifetimes.renew_before_s:
        return f"the CA expires at {signing.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}"
    return None


def issue(
    name: str,
    hosts: Sequence[str],
    lifetimes: Lifetimes,
    previous: Bundle | None = None,
    now: datetime.datetime | None = None,
) -> Bundle:
    """A new serving certificate, signed by `previous`'s CA while that has long enough to live,
    else by a new CA; the caBundle keeps the older CAs until they expire, so certificates still
    served by other replicas stay trusted."""
    now = _now(now)
    kept: list[bytes] = []
    ca_cert = ca_key = b""
    if previous is not None:
        try:
            cas = _split_pem(previous.ca_bundle)
            signer = serialization.load_pem_private_key(previous.ca_key, password=None)
        except ValueError:
            cas, signer = [], None
        left = [c for c in cas if c.not_valid_after_utc > now]
        kept = [c.public_bytes(serialization.Encoding.PEM) for c in left]
        if (
            left
            and left[0] is cas[0]
            and signer is not None
            and signer.public_key() == cas[0].public_key()
            and (cas[0].not_valid_after_utc - now).total_seconds() > lifetimes.validity_s + lifetimes.renew_before_s
        ):
            ca_cert, ca_key = kept[0], previous.ca_key
            kept = kept[1:]
    if not ca_cert:
        ca_cert, ca_key = new_ca(f"{name}-ca", lifetimes.ca_validity_s, now)
    cert, key = new_serving(ca_cert, ca_key, hosts, lifetimes.validity_s, now)
    return Bundle(b"".join([ca_cert, *kept]), ca_key, cert, key)


def signing_ca_fingerprint(bundle: Bundle) -> bytes:
    return _split_pem(bundle.ca_bundle)[0].fingerprint(hashes.SHA256())


def trusts(ca_bundle: bytes, cert: bytes) -> bool:
    """Whether a certificate is signed directly by one of the CAs of a caBundle."""
    try:
        served = x509.load_pem_x509_certificate(cert)
        cas = _split_pem(ca_bundle)
    except ValueError:
        return False
    for ca in cas:
        try:
            served.verify_directly_issued_by(ca)
            return True
        except (ValueError, TypeError, InvalidSignature):
            continue
    return False

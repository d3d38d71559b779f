"""Node identity (an Ed25519 key in the node's data directory) and TLS certificates.

A node's id is its 32-byte Ed25519 public key. The key is created at first start,
stored in ``<data-dir>/node.key`` (PEM, mode 0600) and reused afterwards. Signatures
carry a domain string so a signature made for one purpose never verifies for another.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

import attrs
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.x509.oid import NameOID

from protocol.channel import STATIC_KEY_DOMAIN, ChannelKeys
from protocol.noise import public_bytes as x25519_public_bytes

KEY_FILE = "node.key"


class IdentityError(ValueError):
    """A key or certificate could not be loaded or made."""


@attrs.frozen(eq=False)
class Identity:
    """A keypair; ``node_id`` is the raw public key."""

    private_key: Ed25519PrivateKey

    @property
    def node_id(self) -> bytes:
        """The 32-byte public key."""
        return public_bytes(self.private_key.public_key())

    def sign(self, domain: bytes, message: bytes) -> bytes:
        """Sign ``message`` for ``domain`` (64 bytes)."""
        return self.private_key.sign(domain + b"\0" + message)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity."""
        return cls(Ed25519PrivateKey.generate())

    def private_pem(self) -> bytes:
        """The private key as unencrypted PKCS#8 PEM."""
        return self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


def public_bytes(key: Ed25519PublicKey) -> bytes:
    """Raw 32-byte encoding of a public key."""
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def verify(node_id: bytes, domain: bytes, message: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``node_id``'s signature of ``message`` for ``domain``."""
    if len(node_id) != 32 or len(signature) != 64:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(node_id).verify(signature, domain + b"\0" + message)
    except (InvalidSignature, ValueError):
        return False
    return True


def channel_keys(identity: Identity) -> ChannelKeys:
    """Fresh keys for the end-to-end channels of relayed seams, vouched for by ``identity``.

    The Noise static key lives only in this process's memory; each process makes its own.
    """
    static = X25519PrivateKey.generate()
    proof = identity.sign(STATIC_KEY_DOMAIN, x25519_public_bytes(static))
    return ChannelKeys(identity.node_id, static, proof)


def load_or_create(data_dir: str | os.PathLike[str]) -> Identity:
    """The identity in ``data_dir``, created (0600) on first use."""
    return load_or_create_key(Path(data_dir) / KEY_FILE)


def load_or_create_key(path: str | os.PathLike[str]) -> Identity:
    """The Ed25519 key in the PEM file ``path``, made there (mode 0600, with its folder) when missing.

    A new key is written beside ``path`` and renamed into place, so a crash never leaves half a key.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            try:
                key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            except (ValueError, TypeError) as exc:
                raise IdentityError(f"{path} is not a readable private key: {exc}") from None
            if not isinstance(key, Ed25519PrivateKey):
                raise IdentityError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
            return Identity(key)
        identity = Identity.generate()
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.private_pem())
        os.replace(tmp, path)
    except OSError as exc:  # a file in the way, no permission, a full disk
        raise IdentityError(f"cannot keep a key in {path}: {exc}") from None
    return identity


def load_public_key(text: str) -> bytes:
    """A public key given as 64 hex characters, or a file holding them."""
    candidate = text.strip()
    if len(candidate) != 64 and Path(candidate).is_file():
        candidate = Path(candidate).read_text().strip()
    try:
        raw = bytes.fromhex(candidate)
    except ValueError:
        raise IdentityError(f"expected a 64-hex-digit Ed25519 public key (or a file with one), got {text!r}") from None
    if len(raw) != 32:
        raise IdentityError(f"an Ed25519 public key is 32 bytes, got {len(raw)}")
    return raw


@attrs.frozen
class TlsFiles:
    """A certificate and its key on disk, and the pin peers check (sha256 of the DER certificate)."""

    cert: Path
    key: Path

    @property
    def cert_sha256(self) -> bytes:
        """The pin."""
        pem = self.cert.read_bytes()
        return hashlib.sha256(x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)).digest()


def self_signed(
    directory: str | os.PathLike[str], common_name: str = "noderuntime", *, addresses: Sequence[str] = ()
) -> TlsFiles:
    """A self-signed ECDSA P-256 certificate in ``directory`` (made once, then reused).

    ``addresses``: IP addresses it names (a subject alternative name), for a client that
    checks the host it dialled, as TLS to a relay's ``wss://`` URL does.
    """
    directory = Path(directory)
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    if cert_path.exists() and key_path.exists():
        return TlsFiles(cert_path, key_path)
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    )
    if addresses:
        names = [x509.IPAddress(ipaddress.ip_address(address)) for address in addresses]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(key, hashes.SHA256())
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return TlsFiles(cert_path, key_path)

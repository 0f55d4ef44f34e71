"""An HMAC on every message of the submission layer (submissions, aborts, shadow results), from a secret
the gateways and replicas share, which a replica checks before it reads the message. Anyone who can write
to Redis could otherwise submit requests in any tenant's name and cache group, or abort other tenants'
requests; a message whose HMAC does not match is dropped and counted (docs/reliability.md, "The wire").

SHA-256 over the serialized message, 32 bytes in front of it. Stdlib only: both sides import it."""

from __future__ import annotations

import hashlib
import hmac

MAC_BYTES = hashlib.sha256().digest_size


class ForgedMessage(Exception):
    """A message whose HMAC is missing or does not match: not from a holder of the secret."""


class WireSigner:
    def __init__(self, secret: str) -> None:
        # Its own key, derived: the wire's HMAC never doubles as anything else the secret signs.
        self._key = hmac.new(secret.encode(), b"switchyard wire v1", hashlib.sha256).digest()

    def sign(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest() + body

    def unsign(self, data: bytes) -> bytes:
        mac, body = data[:MAC_BYTES], data[MAC_BYTES:]
        if len(mac) != MAC_BYTES or not hmac.compare_digest(
            mac, hmac.new(self._key, body, hashlib.sha256).digest()
        ):
            raise ForgedMessage("the message's HMAC does not match")
        return body

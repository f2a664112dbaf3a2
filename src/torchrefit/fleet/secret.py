"""The fleet's shared secret, and the proofs made with it.

The launcher gives the trainer and every replica the same secret: ``secret=`` (bytes or
str), a file both read (``secret_file=``), or ``settings.fleet_secret`` (environment:
``TORCHREFIT_FLEET_SECRET``). There is no default: without one, ``Fleet`` and ``join``
raise. The secret itself never crosses the network. A joiner proves it holds it with an
HMAC over the fleet's random salt and its own name; the trainer answers with an HMAC of
its own, so a joiner knows the fleet is genuine; and every group that carries weights
rendezvous under a store prefix derived from the secret, which a process without it
cannot compute (it cannot take an admitted replica's place in a group).
"""

from __future__ import annotations

import hashlib
import hmac
import pathlib

from .. import settings

__all__ = ["read_secret", "prove", "check", "group_prefix"]


def read_secret(secret: bytes | str | None, secret_file: str | None, who: str) -> bytes:
    """The secret from the argument, the file, or the setting, in that order; raises
    ``ValueError`` where none is given or it is empty (never a default)."""
    if secret is not None and secret_file is not None:
        raise ValueError(f"{who}: give secret= or secret_file=, not both")
    if secret_file is not None:
        try:
            secret = pathlib.Path(secret_file).read_bytes().strip()
        except OSError as e:
            raise ValueError(f"{who}: cannot read the fleet secret from {secret_file!r}: {e}") from e
    if secret is None:
        secret = settings.current().fleet_secret
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise ValueError(
            f"{who}: no fleet secret: pass secret=, secret_file=, or set TORCHREFIT_FLEET_SECRET "
            "(the launcher gives the trainer and every replica the same one; there is no default)")
    return key


def prove(key: bytes, *parts: str) -> str:
    """HMAC-SHA256 of ``parts`` under the secret, hex."""
    return hmac.new(key, "|".join(parts).encode(), hashlib.sha256).hexdigest()


def check(key: bytes, proof: str, *parts: str) -> bool:
    """Whether ``proof`` is :func:`prove` of ``parts`` (compared in constant time)."""
    return isinstance(proof, str) and hmac.compare_digest(proof, prove(key, *parts))


def group_prefix(key: bytes, salt: str, tag: str) -> str:
    """The store prefix of the group of edge ``tag``: unguessable without the secret."""
    return f"fleet/g/{prove(key, 'group', salt, tag)[:32]}/"

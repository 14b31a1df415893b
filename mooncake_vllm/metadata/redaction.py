"""Store URLs as they may be logged or shown: credentials replaced by ``***``."""

from __future__ import annotations

import re

# A query parameter whose value is a credential: its name is one of these words, alone or as the
# last part of a longer name (access_token, api_key, client_secret, X-Amz-Signature, x-api-key).
_SECRET_QUERY = re.compile(
    r"(?i)(?:(?<=[?&;])|^)((?:[a-z0-9]*[_.-])*"
    r"(?:password|passwd|pass|pwd|token|secret|key|apikey|auth|authorization|credentials?"
    r"|sig|signature))=[^&#;]*"
)


def redact_url(url: str) -> str:
    """``url`` with any ``user:password@`` (or ``user@``) and secret-looking query values
    replaced by ``***``: the only form of a store URL that may be logged or shown."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/") if sep else url.partition("/")
    _, at, host = netloc.rpartition("@")
    if at:
        netloc = f"***@{host}"
    redacted = f"{scheme}{sep}{netloc}{slash}{tail}" if sep else f"{netloc}{slash}{tail}"
    return _SECRET_QUERY.sub(lambda m: f"{m.group(1)}=***", redacted)


def url_has_credentials(url: str) -> bool:
    return redact_url(url) != url

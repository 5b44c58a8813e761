"""Keep credentials out of reports: secret-looking names and credentials inside values.

Two layers, both returning new objects and never raising:

* :func:`redact_text` rewrites one string: the password in a URL's userinfo (``https://user:pw@host``), the
  values of secret-named query or ``name=value`` parameters (``?token=...&api_key=...``) and the credential
  after ``Bearer``, ``Basic`` or an ``Authorization:`` header become :data:`REDACTED`; the rest stays readable.
* :func:`redact_secrets` walks dicts, lists, tuples and sets: strings and containers stored under a
  secret-looking key (:func:`is_secret_name`) become :data:`REDACTED`, every other string goes through
  :func:`redact_text`, and other scalars are returned as they are.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["REDACTED", "SECRET_FRAGMENTS", "is_secret_name", "redact_secrets", "redact_text"]

#: Name fragments (upper case) that mark a name as secret: its value is replaced by :data:`REDACTED`.
SECRET_FRAGMENTS: tuple[str, ...] = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
#: What a secret is replaced with.
REDACTED = "<redacted>"

#: Query-parameter names that carry a credential without containing one of :data:`SECRET_FRAGMENTS`.
_SECRET_PARAMS = frozenset({"sig", "signature", "pwd", "pass", "passphrase"})
#: Containers nested deeper than this are replaced whole: cheaper than walking them and never leaks.
_MAX_DEPTH = 64

# scheme://userinfo@ : the userinfo ends at the last "@" before the path, query, fragment or a space.
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/?#\s]*)@")
# name=value where name starts at a boundary (start, space, ?, &, ;, quote, ...).
_PARAM = re.compile(r"(?<![\w.\-\[\]])(?P<name>[\w.\-\[\]]+)=(?P<value>[^&#;,\s\"'<>]+)")
_AUTHORIZATION = re.compile(
    r"(?P<head>\b(?:proxy-)?authorization\s*[:=]\s*(?:[A-Za-z][\w\-]*\s+)?)(?P<credential>[^\s\"',;]+)",
    re.IGNORECASE,
)
_BEARER = re.compile(r"(?P<head>\bbearer\s+)(?P<credential>[A-Za-z0-9\-._~+/]+=*)", re.IGNORECASE)
_BASIC = re.compile(r"(?P<head>\bbasic\s+)(?P<credential>[A-Za-z0-9+/]{4,}={0,2})", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """Whether a variable, key or parameter called ``name`` may hold a secret.

    Example:
        >>> is_secret_name("TORCH_HUB_TOKEN"), is_secret_name("api_key"), is_secret_name("NCCL_DEBUG")
        (True, True, False)
    """
    upper = str(name).upper()
    return any(fragment in upper for fragment in SECRET_FRAGMENTS)


def _is_secret_param(name: str) -> bool:
    lower = name.lower()
    return is_secret_name(name) or lower in _SECRET_PARAMS or lower.endswith("signature")


def _looks_like_credential(text: str) -> bool:
    """Long, or mixing digits/symbols into letters: a token, not an English word after ``Bearer``."""
    if len(text) >= 16:
        return True
    return len(text) >= 8 and any(not c.isalpha() for c in text)


def _is_basic_credential(text: str) -> bool:
    """Base64 of ``user:password``, which is what follows ``Basic`` in an HTTP header."""
    try:
        decoded = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        return False
    return b":" in decoded


def _userinfo(match: re.Match[str]) -> str:
    user, colon, _ = match.group("userinfo").partition(":")
    # user:password keeps the user; a lone userinfo is usually a token (https://<token>@host), so all of it goes.
    kept = f"{user}:{REDACTED}" if colon else REDACTED
    return f"{match.group('scheme')}{kept}@"


def _param(match: re.Match[str]) -> str:
    if not _is_secret_param(match.group("name")):
        return match.group(0)
    return f"{match.group('name')}={REDACTED}"


def _bearer(match: re.Match[str]) -> str:
    if not _looks_like_credential(match.group("credential")):
        return match.group(0)
    return match.group("head") + REDACTED


def _basic(match: re.Match[str]) -> str:
    if not _is_basic_credential(match.group("credential")):
        return match.group(0)
    return match.group("head") + REDACTED


def redact_text(text: str) -> str:
    """``text`` with the credentials inside it replaced by ``"<redacted>"``.

    Replaced: the password of a URL's userinfo (all of the userinfo when it has no ``:``, as in
    ``https://<token>@host``); the value of a ``name=value`` parameter whose name looks secret (``token``,
    ``access_token``, ``key``, ``api_key``, ``password``, ``secret``, ``sig``, ``signature``, anything with
    KEY, TOKEN, SECRET, PASSWORD, PASSWD, CREDENTIAL or AUTH in it); the credential after
    ``Authorization:``, after ``Bearer`` (when it looks like a token) and after ``Basic`` (when it is base64 of
    ``user:password``). Everything else is returned unchanged. A non-string is returned as it is.

    Example:
        >>> redact_text("https://alice:hunter2@example.com/data?x=1&token=abc123")
        'https://alice:<redacted>@example.com/data?x=1&token=<redacted>'
        >>> redact_text("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.ZRrHA1JJJW8opsbCGfG_HACGpVUMN_a9IV7pAx_Zmeo")
        'Authorization: Bearer <redacted>'
        >>> redact_text("https://example.com/path?x=1")
        'https://example.com/path?x=1'
    """
    if not isinstance(text, str):
        return text
    try:
        text = _URL_USERINFO.sub(_userinfo, text)
        text = _AUTHORIZATION.sub(lambda m: m.group("head") + REDACTED, text)
        text = _BEARER.sub(_bearer, text)
        text = _BASIC.sub(_basic, text)
        return _PARAM.sub(_param, text)
    except Exception:  # never expected; a report must not fail because of redaction
        return REDACTED


def _redact_under_secret_key(value: Any) -> Any:
    # Numbers, flags and None are not credentials (``num_key_value_heads=8``, ``use_auth=True``); anything
    # else under a secret-looking key is.
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return REDACTED


def _redact(obj: Any, depth: int, active: set[int]) -> Any:
    if isinstance(obj, str):
        return redact_text(obj)
    if not isinstance(obj, (Mapping, list, tuple, set, frozenset)):
        return obj
    if depth >= _MAX_DEPTH or id(obj) in active:
        return REDACTED
    active.add(id(obj))
    try:
        if isinstance(obj, Mapping):
            out: dict[Any, Any] = {}
            for key, value in obj.items():
                secret = is_secret_name(key) if isinstance(key, str) else False
                new_key = redact_text(key) if isinstance(key, str) else key
                out[new_key] = _redact_under_secret_key(value) if secret else _redact(value, depth + 1, active)
            return out
        items = [_redact(value, depth + 1, active) for value in obj]
        if isinstance(obj, list):
            return items
        if isinstance(obj, tuple):
            return tuple(items)
        return type(obj)(items) if type(obj) in (set, frozenset) else set(items)
    except Exception:  # an odd container that cannot be walked: leak nothing, raise nothing
        return REDACTED
    finally:
        active.discard(id(obj))


def redact_secrets(obj: Any) -> Any:
    """A copy of ``obj`` with the secrets in it replaced by ``"<redacted>"``; ``obj`` is not changed.

    Walks mappings (returned as ``dict``), lists, tuples and sets. A string or container stored under a key
    that :func:`is_secret_name` flags becomes ``"<redacted>"`` (numbers, booleans and ``None`` under such a
    key are kept: they are settings such as ``num_key_value_heads``, not credentials); every other string goes
    through :func:`redact_text`. Other objects (numbers, tensors, ...) are returned as they are. A container
    that contains itself, or that is nested more than 64 deep, is replaced whole. Never raises.

    Example:
        >>> redact_secrets({"lr": 0.1, "api_key": "sk-123", "logger": {"uri": "https://u:pw@host/x"}})
        {'lr': 0.1, 'api_key': '<redacted>', 'logger': {'uri': 'https://u:<redacted>@host/x'}}
    """
    try:
        return _redact(obj, 0, set())
    except Exception:
        return REDACTED

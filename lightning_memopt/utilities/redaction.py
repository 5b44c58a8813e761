"""Keep credentials out of reports: which names hold a secret, secrets inside strings, secrets inside structures.

**Names** (keys, fields, variables, flags, parameters): :func:`is_secret_name` decides on whole words of the
name, not substrings. A name is split into its words at ``_``, ``-``, ``.``, spaces and camelCase boundaries
(``wandbApiKey`` -> ``wandb api key``, ``AWS_SECRET_ACCESS_KEY`` -> ``aws secret access key``), and the words
decide: ``api_key``, ``access_token``, ``db_password`` and ``client_secret`` are secret; ``tokenizer_name``,
``author``, ``keyframe_dir``, ``sort_key``, ``auth_mode`` and ``pad_token`` are not.

**Strings**: :func:`redact_text` finds the credentials inside one string in time linear in its length. No
character is read by more than a bounded number of regex attempts: a pattern starts at a literal word
(``authorization``, ``bearer``, one of the words that can make a name secret) or at the first character of a
run (a negative lookbehind on the run's own class), and what follows a repeat can never match a character the
repeat takes, so giving characters back costs at most the run once. (No possessive quantifiers: Python 3.10 has
none.) What a regex cannot do in one pass (where a URL's userinfo ends, where a value ends, matching quotes) is
done by hand with ``str.find`` from a position that only moves forward.

**Shapes**: some credentials say what they are whatever name they stand under, in a value, a dict key, a URL or
free text: JWTs, PEM private-key blocks, AWS access key ids, GitHub, Hugging Face, OpenAI-style and Slack tokens.
They are recognised by their prefix and a body long and random enough that ordinary names (``sk-learn``,
``hf_hub_download``), hashes, UUIDs, run ids and base64 data are left alone.

**Structures**: :func:`redact_secrets` walks a value field by field before anything becomes a string: mappings,
lists, tuples, sets, dataclasses, named tuples, ``argparse.Namespace`` and other objects with a ``__dict__``. A
value stored under a secret name is replaced whole; every string goes through :func:`redact_text` and is capped in
size. The walk is its own, not ``lightning_utilities``' ``apply_to_collection``: what a value becomes depends on
the key or flag it stands under (a mapping's keys, the item after ``--db-password``, a ``{"name": ..., "value":
...}`` entry), and the walk keeps depth, item and value budgets and a cycle guard.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import re
import types
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

__all__ = [
    "MAX_VALUE_CHARS",
    "REDACTED",
    "SECRET_WORDS",
    "cap_text",
    "is_secret_name",
    "name_words",
    "redact_secrets",
    "redact_text",
]

# === SECRET NAMES ============================================================================================

#: What a secret is replaced with.
REDACTED = "<redacted>"

#: Words that make a name secret wherever they stand in it (``db_password``, ``gcp_credentials``, ``MYSQL_PWD``).
SECRET_WORDS: tuple[str, ...] = (
    "password",
    "passwd",
    "pwd",
    "passphrase",
    "secret",
    "secrets",
    "credential",
    "credentials",
    "creds",
    "bearer",
    "authorization",
    "jwt",
    "cookie",
    "cookies",
    "webhook",
    "dsn",
    "apikey",
    "apikeys",
    "accesskey",
    "secretkey",
    "privatekey",
    "authkey",
    "accesstoken",
    "authtoken",
    "refreshtoken",
    "sessiontoken",
    "apitoken",
    "clientsecret",
)
#: Inside one word (no separators: ``PGPASSWORD``, ``dbPassword`` already splits) these still mark a secret.
_SECRET_INFIXES = ("password", "passwd", "passphrase", "credential", "apikey", "secretkey", "privatekey")
#: Names that are secret on their own but harmless as part of a longer name (``?key=``, ``?sig=``, ``auth=``).
_SECRET_ALONE = frozenset({"key", "token", "auth", "pass", "sig", "signature", "otp"})
#: ``<word> key``: the key is a credential (``api_key``, ``AWS_SECRET_ACCESS_KEY``, ``AccountKey``).
_KEY_OWNERS = frozenset(
    {
        "api",
        "access",
        "secret",
        "private",
        "client",
        "signing",
        "sign",
        "encryption",
        "encrypt",
        "master",
        "ssh",
        "gpg",
        "pgp",
        "license",
        "licence",
        "account",
        "storage",
        "subscription",
        "consumer",
        "service",
        "deploy",
        "app",
        "auth",
        "hmac",
        "session",
        "shared",
        "aes",
        "rsa",
        "crypto",
    }
)
#: ``<word> token`` where the token is a piece of text, not a credential (``pad_token``, ``eos_token``).
_TEXT_TOKENS = frozenset(
    {
        "pad",
        "bos",
        "eos",
        "unk",
        "sep",
        "cls",
        "mask",
        "start",
        "end",
        "stop",
        "special",
        "additional",
        "image",
        "audio",
        "video",
        "vision",
        "boi",
        "eoi",
        "decoder",
        "encoder",
        "prefix",
        "suffix",
        "placeholder",
        "split",
        "max",
        "min",
        "num",
        "first",
        "last",
        "next",
        "new",
        "extra",
        "sentinel",
        "control",
        "word",
        "byte",
        "subword",
        "vocab",
    }
)
#: ``auth <word>``: an authorization credential (``auth_header``), not a setting (``auth_mode``).
_AUTH_CREDENTIALS = frozenset({"header", "headers", "string", "info", "cookie", "value", "data", "code", "pass"})
#: ``<word> pass``: a password (``db_pass``), not a pass over data (``forward_pass``).
_PASS_OWNERS = frozenset(
    {"db", "user", "admin", "root", "login", "proxy", "smtp", "ftp", "mail", "email", "sql", "mysql", "redis", "ldap"}
)
#: ``<word> signature``/``sig``: a request signature (``X-Amz-Signature``).
_SIGNATURE_WORDS = frozenset({"signature", "sig"})
#: Names longer than this are judged by their last this-many characters (the part a key's name ends with).
_MAX_NAME_CHARS = 256

# Words: a run of capitals before a capitalised word (the "API" of "APIKey"), a capitalised or lower-case word,
# a run of capitals, a number. Everything else (``_``, ``-``, ``.``, spaces, brackets) separates.
_WORD = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")


def name_words(name: str) -> list[str]:
    """The lower-case words of ``name`` (its last 256 characters when longer).

    Examples:
        >>> name_words("wandbApiKey"), name_words("AWS_SECRET_ACCESS_KEY"), name_words("--db-password")
        (['wandb', 'api', 'key'], ['aws', 'secret', 'access', 'key'], ['db', 'password'])
    """
    return [word.lower() for word in _WORD.findall(str(name)[-_MAX_NAME_CHARS:])]


def _is_secret_words(words: list[str]) -> bool:
    if len(words) == 1 and words[0] in _SECRET_ALONE:
        return True
    for i, word in enumerate(words):
        before = words[i - 1] if i else ""
        after = words[i + 1] if i + 1 < len(words) else ""
        if word in SECRET_WORDS or any(infix in word for infix in _SECRET_INFIXES):
            return True
        if word in ("key", "keys") and before in _KEY_OWNERS:
            return True
        if word == "token" and not after and before not in _TEXT_TOKENS:
            return True
        if word == "auth" and after in _AUTH_CREDENTIALS:
            return True
        if word == "pass" and not after and before in _PASS_OWNERS:
            return True
        if word in _SIGNATURE_WORDS and not after:
            return True
    return False


@lru_cache(maxsize=4096)
def _is_secret_cached(name: str) -> bool:
    return _is_secret_words(name_words(name))


def is_secret_name(name: object) -> bool:
    """Whether a key, field, variable, flag or parameter called ``name`` may hold a secret.

    Decided on the whole words of the name (:func:`name_words`), never on substrings: a word from
    :data:`SECRET_WORDS` anywhere (``db_password``, ``client_secret``, ``gcp_credentials``); ``key`` after
    ``api``/``access``/``secret``/``private``/``client``/... (``api_key``, ``AWS_SECRET_ACCESS_KEY``); a name
    ending in ``token`` unless it is a piece of text (``access_token``, ``HF_TOKEN``, not ``pad_token``);
    ``auth`` before ``header``/``string``/... (``auth_header``, not ``auth_mode``); ``key``, ``token``,
    ``auth``, ``pass``, ``sig`` or ``signature`` as the whole name. Not a string: ``False``.

    Examples:
        >>> [is_secret_name(n) for n in ("TORCH_HUB_TOKEN", "api_key", "clientSecret", "--db-password")]
        [True, True, True, True]
        >>> [is_secret_name(n) for n in ("NCCL_DEBUG", "tokenizer_name", "sort_key", "author", "pad_token")]
        [False, False, False, False, False]
    """
    if not isinstance(name, str):
        return False
    return _is_secret_cached(name[-_MAX_NAME_CHARS:])


# === SECRETS IN STRINGS ======================================================================================

#: The longest string kept whole in a report (characters); the rest is cut with a ``...[truncated N chars]`` marker.
MAX_VALUE_CHARS = 65_536
# A string at most this much over the cap is kept (a string that was already cut, with its marker, stays as it is).
_MARKER_ROOM = 64
# How far past the cap a cut string is still scanned, so that a secret across the cut is seen whole.
_SCAN_MARGIN = 4096
# Candidates (a secret-looking word before a separator, a URL with "@") examined in one string by one pass; past
# this, the rest of the string is replaced by a marker: no configuration holds that many, and time stays bounded.
_MAX_HITS = 20_000

# --- URLs: scheme://userinfo@host ----------------------------------------------------------------------------
# A scheme (entered at its first character) and what follows up to the first "@", stopping at a space, a quote
# or the next "://": every character is read by one attempt only.
_URL_WITH_AT = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://(?:[^\s\"'<>`@:]|:(?!//))*@")
_URL_END = re.compile(r"[\s\"'<>`]|://")
_AUTHORITY_END = re.compile(r"[/?#]")

# --- HTTP authorization ----------------------------------------------------------------------------------------
_AUTH_SCHEMES = r"(?:bearer|basic|token|digest|negotiate|ntlm|dpop|apikey|oauth|aws4-hmac-sha256)"
_AUTHORIZATION = re.compile(
    r"(?P<head>\b(?:proxy-)?authorization[\"']?[ \t]*[:=][ \t]*[\"']?(?:" + _AUTH_SCHEMES + r"[ \t]+)?)"
    r"(?P<credential>[^\s\"',;]+)",
    re.IGNORECASE,
)
_BEARER = re.compile(r"(?P<head>\bbearer\s+)(?P<credential>[A-Za-z0-9\-._~+/]+=*)", re.IGNORECASE)
_BASIC = re.compile(r"(?P<head>\bbasic\s+)(?P<credential>[A-Za-z0-9+/]{4,}={0,2})", re.IGNORECASE)

# --- name/value pairs ------------------------------------------------------------------------------------------
# Searched in the lower-cased text. A word that can make a name secret, the rest of the name up to the next such
# word (so that no character is read by two attempts), a closing quote, spaces and a separator:
# name=value | name = value | name: value | "name": value | 'name', 'value'. The name's start is found backwards
# from the word (_NAME_TAIL). A flag (--name value) is entered only at a "-" that starts a word, and only when a
# word that can make it secret follows, also as its first word (--password); the lookahead reads the flag once.
_TRIGGERS = r"(?:pass|pwd|secret|cred|bearer|auth|jwt|cookie|webhook|dsn|key|token|sig|otp)"
_PAIR = re.compile(
    _TRIGGERS + r"(?:(?!" + _TRIGGERS + r")[a-z0-9_\-])*(?P<close>\\?[\"'])?(?P<space>[ \t]*)"
    r"(?P<sep>[:=]|(?<=[\"']),)"
)
_FLAG = re.compile(
    r"-(?<![a-z0-9_\-]-)(?=-?(?=[a-z])[a-z0-9_\-]*?" + _TRIGGERS + r")-?[a-z][a-z0-9_\-]*(?P<space>[ \t]+)"
    r"(?![ \t]|[\"']?-)"
)
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_NAME_TAIL = re.compile(r"(?<![A-Za-z0-9_\-])[A-Za-z0-9_\-]*\Z")
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
# {"name": "DB_PASSWORD", "value": "x"} and its YAML form (- name: DB_PASSWORD / value: x).
_NAMED_VALUE = re.compile(
    r"\b(?:name|key)[\"']?[ \t]*[:=][ \t]*[\"']?(?P<secret_name>[A-Za-z0-9_\-.]+)[\"']?[\s,]*"
    r"[\"']?value[\"']?[ \t]*(?P<sep>[:=])"
)
_TIGHT_END = re.compile(r"[\s&#;,\"'<>()\[\]{}]")  # name=value in a URL query, a command line, a repr
_LINE_END = re.compile(r"[\r\n,}\]]")  # name: value (YAML, headers) and name = value (INI): to the end of the line
_WORD_END = re.compile(r"\s")  # --flag value
_SPACES = re.compile(r"[ \t]*")
_VALUE_ENDS = {"tight": _TIGHT_END, "line": _LINE_END, "word": _WORD_END}
_CONSTANTS = frozenset({"", "None", "null", "true", "false", "True", "False", "~", REDACTED})
#: A secret flag whose last word is one of these takes no value (``--password-stdin``): the next word is kept.
_VALUELESS_FLAG_ENDS = frozenset({"stdin"})

# --- credentials known by their shape, whatever name they stand under ----------------------------------------
# PEM private-key blocks: what lies between the BEGIN and END lines goes (to the end of the text without an END).
_PEM_BEGIN = re.compile(r"-----BEGIN (?:[A-Z0-9]{1,16} ){0,3}PRIVATE KEY(?: BLOCK)?-----")
_PEM_END = re.compile(r"-----END (?:[A-Z0-9]{1,16} ){0,3}PRIVATE KEY(?: BLOCK)?-----")
# Each entered at its literal start, where no character of its own run comes before; every repeat is bounded and
# no character after it can be one the repeat takes, so an attempt reads a bounded stretch once.
_TOKEN_SHAPES = re.compile(
    # a JWT: base64url of '{"' (eyJ) and two more base64url parts (the signature may be empty: alg "none")
    r"(?<![A-Za-z0-9_\-])eyJ[A-Za-z0-9_\-]{12,4096}\.[A-Za-z0-9_\-]{2,65536}\.[A-Za-z0-9_\-]{0,4096}"
    # an AWS access key id (long-term AKIA, temporary ASIA)
    r"|(?<![A-Za-z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Za-z0-9])"
    # GitHub, Hugging Face, OpenAI-style and Slack tokens: a prefix and a random body (_random_body decides)
    r"|(?<![A-Za-z0-9])(?:gh[pousr]_|github_pat_|hf_|sk-|xox[abeprs]-)(?P<body>[A-Za-z0-9_\-]{10,1024})"
)
_ALNUM_RUN = re.compile(r"[A-Za-z0-9]+")
#: A prefixed token's body holds a run of letters and digits at least this long mixing two of lower case, upper
#: case and digits (GitHub's and Hugging Face's 36 and 34, Slack's last 24): ``sk-learn``, ``hf_hub_download``
#: and ``sk-resnet50-finetuned`` are names, not tokens.
_TOKEN_MIN_RUN = 24


def cap_text(text: str, max_chars: int = MAX_VALUE_CHARS) -> str:
    """``text`` cut to ``max_chars`` characters with a ``...[truncated N chars]`` marker (N: how many were cut).

    A string no more than 64 characters over the cap is returned whole, so that cutting twice changes nothing.

    Examples:
        >>> cap_text("x" * 200, max_chars=10)
        'xxxxxxxxxx...[truncated 190 chars]'
    """
    if len(text) <= max_chars + _MARKER_ROOM:
        return text
    return f"{text[:max_chars]}...[truncated {len(text) - max_chars} chars]"


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


def _authority_end(region: str, start: int = 0) -> int:
    """Where the authority of ``region`` that goes on at ``start`` ends: its first ``/``, ``?`` or ``#``, else the
    end of ``region``."""
    found = _AUTHORITY_END.search(region, start)
    if found:
        return found.start()
    return len(region)


def _userinfo_end(region: str) -> int | None:
    """Where the userinfo of ``region`` (a URL after ``scheme://``) ends (its ``@``), ``None`` without one.

    The standard form ends at the last ``@`` before the first ``/``, ``?`` or ``#``. A password holding one of
    those (``u:pa/ss@host``) is recognised too: ``user:`` followed by something that is not a port, then ``@``.
    """
    authority_end = _authority_end(region)
    at = region.rfind("@", 0, authority_end)
    if at >= 0:
        return at
    colon = region.find(":", 0, authority_end)
    if colon < 0 or authority_end == len(region) or region[colon + 1 : authority_end].isdigit():
        return None
    at = region.find("@", authority_end)
    if at < 0:
        return None
    return region.rfind("@", 0, _authority_end(region, at))


def _redact_userinfo(userinfo: str) -> str:
    user, colon, _ = userinfo.partition(":")
    if colon:  # user:password keeps the user
        return f"{user}:{REDACTED}"
    # A lone userinfo is a user (git@host) or a token (https://<token>@host): tokens are long and have digits.
    if len(user) >= 16 or (len(user) >= 12 and any(c.isdigit() for c in user)) or user == REDACTED:
        return REDACTED
    return userinfo


def _url_end(text: str, start: int) -> int:
    """Where the URL that goes on at ``start`` ends: at the next URL or the end of this one, else the end of
    ``text``."""
    found = _URL_END.search(text, start)
    if found:
        return found.start()
    return len(text)


def _redact_urls(text: str) -> str:
    if "@" not in text or "://" not in text:
        return text
    out: list[str] = []
    pos = search = hits = 0
    while (match := _URL_WITH_AT.search(text, search)) is not None:
        hits += 1
        if hits > _MAX_HITS:
            return "".join(out) + text[pos : match.start()] + _rest_not_scanned(text, match.start())
        search = match.end()
        begin = text.index("://", match.start()) + 3
        region = text[begin : _url_end(text, match.end())]
        userinfo_end = _userinfo_end(region)
        if userinfo_end is None:
            continue
        out += [text[pos:begin], _redact_userinfo(region[:userinfo_end])]
        pos = begin + userinfo_end
        search = max(search, pos + 1)
    return "".join(out) + text[pos:]


def _sub(pattern: re.Pattern[str], text: str, replace: Callable[[re.Match[str]], str]) -> str:
    """``pattern.sub(replace, text)``, stopping after :data:`_MAX_HITS` matches (the rest becomes a marker)."""
    out: list[str] = []
    pos = 0
    for hits, match in enumerate(pattern.finditer(text)):
        if hits >= _MAX_HITS:
            return "".join(out) + text[pos : match.start()] + _rest_not_scanned(text, match.start())
        out += [text[pos : match.start()], replace(match)]
        pos = match.end()
    return "".join(out) + text[pos:]


def _bearer(match: re.Match[str]) -> str:
    credential = match.group("credential")
    if _looks_like_credential(credential):
        return match.group("head") + REDACTED
    return match.group(0)


def _basic(match: re.Match[str]) -> str:
    credential = match.group("credential")
    if _is_basic_credential(credential):
        return match.group("head") + REDACTED
    return match.group(0)


def _authorization(text: str, low: str) -> str:
    if "authorization" in low:
        text = _sub(_AUTHORIZATION, text, lambda m: m.group("head") + REDACTED)
    if "bearer" in low:
        text = _sub(_BEARER, text, _bearer)
    if "basic" in low:
        text = _sub(_BASIC, text, _basic)
    return text


def _closing_quote(text: str, start: int, quote: str) -> int:
    """Index of the first ``quote`` at or after ``start`` not escaped by a backslash; -1 if none."""
    j = start
    while (j := text.find(quote, j)) >= 0:
        k = j
        while k > start and text[k - 1] == "\\":
            k -= 1
        if (j - k) % 2 == 0:
            return j
        j += 1
    return -1


def _skip_spaces(text: str, i: int) -> int:
    found = _SPACES.match(text, i)
    if found:
        return found.end()
    return i


def _value_span(text: str, start: int, style: str) -> tuple[int, int] | None:
    """``(begin, end)`` of the value that starts at ``start``; quotes are kept out of it. ``None``: no value."""
    n = len(text)
    i = _skip_spaces(text, start)
    if i >= n:
        return None
    if text[i] in "\"'":
        j = _closing_quote(text, i + 1, text[i])
        end = n if j < 0 else j
        after = _skip_spaces(text, min(end + 1, n))
        if style == "comma" and text[after : after + 1] == ":":
            return None  # 'DB_PASSWORD', 'value': ... - the quoted word is the next key, not a value
        return i + 1, end
    if text[i] == "\\" and text[i + 1 : i + 2] in ('"', "'"):
        j = text.find(text[i : i + 2], i + 2)
        return i + 2, n if j < 0 else j
    if style == "comma":  # 'token', 'abc': only a quoted value counts
        return None
    found = _VALUE_ENDS[style].search(text, i)
    end = n
    if found:
        end = found.start()
    if style == "line":
        end = i + len(text[i:end].rstrip(" \t"))
    return i, end


def _lower(text: str) -> str:
    """``text`` lower-cased, index for index (``str.lower`` lengthens a few non-ASCII letters)."""
    low = text.lower()
    if len(low) == len(text):
        return low
    return text.translate(_ASCII_LOWER)


@lru_cache(maxsize=4096)
def _is_secret_key(name: str) -> bool:
    # An Authorization header keeps its scheme word: _AUTHORIZATION redacts only the credential after it.
    return is_secret_name(name) and "authorization" not in name_words(name)


def _rest_not_scanned(text: str, start: int) -> str:
    return f"{REDACTED}...[{len(text) - start} chars not scanned: more than {_MAX_HITS} candidates]"


def _name_end(match: re.Match[str]) -> int:
    """Where the name of a ``name<sep>`` match ends: at its closing quote, else where the spaces after it start."""
    if match.group("close"):
        return match.start("close")
    return match.start("space")


def _pair(match: re.Match[str], text: str, search: int) -> str | None:
    """How the value after a ``name<sep>`` match is delimited, when the name is secret; ``None`` to leave it."""
    start = match.start()
    if start > search and text[start - 1] in _NAME_CHARS:  # the word is inside the name: find where it starts
        found = _NAME_TAIL.search(text, search, start)
        if found:
            start = found.start()
    if text[max(0, start - 3) : start] == "://" and text.startswith(REDACTED, match.end()):
        return None  # a URL's user (https://x-access-token:<redacted>@host): its password went with the URL's
    if not _is_secret_key(text[start : _name_end(match)]):
        return None
    sep = match.group("sep")
    if sep == ",":
        return "comma"
    if sep == ":" or match.group("space") or text[match.end() : match.end() + 1] in (" ", "\t"):
        return "line"
    return "tight"


def _is_valued_secret_flag(flag: str) -> bool:
    """Whether ``flag`` (``--db-password``) is secret and takes a value (not ``--password-stdin``)."""
    if not is_secret_name(flag):
        return False
    words = name_words(flag)
    return not words or words[-1] not in _VALUELESS_FLAG_ENDS


def _flag(match: re.Match[str], text: str, search: int) -> str | None:
    return "word" if _is_valued_secret_flag(text[match.start() : match.start("space")]) else None


def _named_value(match: re.Match[str], text: str, search: int) -> str | None:
    if not is_secret_name(text[match.start("secret_name") : match.end("secret_name")]):
        return None
    return "line" if match.group("sep") == ":" else "tight"


def _scan(text: str, pattern: re.Pattern[str], decide: Callable[[re.Match[str], str, int], str | None]) -> str:
    """``text`` with the values after ``pattern``'s matches (searched in its lower-case form) redacted where
    ``decide`` gives their delimiting style. The search only moves forward."""
    low = _lower(text)
    out: list[str] = []
    pos = search = hits = 0
    while (match := pattern.search(low, search)) is not None:
        hits += 1
        if hits > _MAX_HITS:
            return "".join(out) + text[pos : match.start()] + _rest_not_scanned(text, match.start())
        style = decide(match, text, search)
        search = match.end()
        if style is None:
            continue
        span = _value_span(text, match.end(), style)
        if span is None or text[span[0] : span[1]] in _CONSTANTS:
            continue
        out += [text[pos : span[0]], REDACTED]
        pos = search = max(span[1], search)
    return "".join(out) + text[pos:]


def _redact_private_keys(text: str) -> str:
    """``text`` with the body of each PEM private-key block replaced; its BEGIN and END lines are kept."""
    if "PRIVATE KEY" not in text:
        return text
    out: list[str] = []
    pos = 0
    while (begin := _PEM_BEGIN.search(text, pos)) is not None:
        end = _PEM_END.search(text, begin.end())
        if end is None:  # cut off (a capped value) or malformed: everything after the BEGIN line may be the key
            return "".join(out) + text[pos : begin.end()] + REDACTED
        out += [text[pos : begin.end()], REDACTED]
        pos = end.start()
    return "".join(out) + text[pos:]


def _random_body(body: str) -> bool:
    """Whether a prefixed token's ``body`` holds a long run of letters and digits that mixes character classes."""
    for run in _ALNUM_RUN.findall(body):
        if len(run) < _TOKEN_MIN_RUN:
            continue
        classes = (any(c.islower() for c in run), any(c.isupper() for c in run), any(c.isdigit() for c in run))
        if sum(classes) >= 2:
            return True
    return False


def _token_shape(match: re.Match[str]) -> str:
    body = match.group("body")
    if body is not None and not _random_body(body):
        return match.group(0)
    return REDACTED


def _redact_all(text: str) -> str:
    text = _redact_private_keys(text)  # first: a name/value pass would take only the BEGIN line
    low = _lower(text)
    text = _authorization(_redact_urls(text), low)
    if "value" in low:
        text = _scan(text, _NAMED_VALUE, _named_value)
    if "-" in low:
        text = _scan(text, _FLAG, _flag)
    text = _scan(text, _PAIR, _pair)
    # last: a token under a secret name has gone whole above, so no name=<prefix><redacted> is left
    return _sub(_TOKEN_SHAPES, text, _token_shape)


def redact_text(text: str, max_chars: int | None = None) -> str:
    """``text`` with the credentials inside it replaced by ``"<redacted>"``, in time linear in its length.

    Replaced: the password of a URL's userinfo, also one holding ``/``, ``?`` or ``#`` (all of a lone userinfo
    that looks like a token, as in ``https://<token>@host``; a plain user as in ``git@host`` stays); the
    credential after ``Authorization:``, after ``Bearer`` (when it looks like a token) and after ``Basic`` (when
    it is base64 of ``user:password``); the value after a secret name (:func:`is_secret_name`) in every
    key/value syntax: ``name=value`` (query strings, env files, command lines), ``name='value'`` (a ``repr``),
    ``name: value`` (YAML, headers), ``"name": "value"`` (JSON, a dict's repr), ``name = value`` (INI),
    ``--name value`` and ``--name=value`` (command lines), ``'name', 'value'`` (a pair's repr) and
    ``{"name": "DB_PASSWORD", "value": ...}``. ``None``, ``null``, ``true`` and ``false`` values are kept.

    A flag is secret by the same rule as any name, wherever the secret word stands in it: ``--password``,
    ``--token``, ``--key``, ``--jwt``, ``--db-password`` and also ``--password-file``, ``--token-path``: a
    flag's value may be the secret as easily as where it is kept, and a path costs little to lose. A flag that
    ends in ``stdin`` (``--password-stdin``) takes no value: the word after it stays. Short flags (``-p``) are
    not recognised; a word starting with ``-`` after a flag is the next flag, not its value.

    Credentials known by their shape go wherever they stand (the whole token; of a private key, what lies
    between its ``-----BEGIN ... PRIVATE KEY-----`` and ``-----END ...`` lines, or everything after the BEGIN
    line when the END line is missing): JWTs (``eyJ...``, three base64url parts), AWS access key ids
    (``AKIA``/``ASIA`` and 16 capitals or digits), GitHub tokens (``ghp_``, ``gho_``, ``ghu_``, ``ghs_``,
    ``ghr_``, ``github_pat_``), Hugging Face ``hf_``, OpenAI-style ``sk-`` and Slack ``xoxb-``/``xoxp-``/... tokens.
    A prefixed token counts only when its body holds a run of at least 24 letters and digits mixing two of
    lower case, upper case and digits, so that ``sk-learn``, ``hf_hub`` or ``sk-resnet50-finetuned`` stay.
    A non-string is returned as it is.

    Args:
        text: The string to redact.
        max_chars: Cut the result to this many characters with a ``...[truncated N chars]`` marker
            (:func:`cap_text`); only the part kept (and a margin) is scanned. Default: no cap.

    Examples:
        >>> redact_text("https://alice:hunter2@example.com/data?x=1&token=abc123")
        'https://alice:<redacted>@example.com/data?x=1&token=<redacted>'
        >>> redact_text("Namespace(lr=0.1, db_password='hunter2', tokenizer='t5-small')")
        "Namespace(lr=0.1, db_password='<redacted>', tokenizer='t5-small')"
        >>> redact_text("https://example.com/path?x=1")
        'https://example.com/path?x=1'
        >>> redact_text("python train.py --password hunter2 --lr 0.1 --model sk-learn")
        'python train.py --password <redacted> --lr 0.1 --model sk-learn'
        >>> redact_text("notify: https://hooks.example/" + "xoxb-1234567890-" + "AbCdEfGhIjKlMnOpQrStUvWx")
        'notify: https://hooks.example/<redacted>'
    """
    if not isinstance(text, str):
        return text
    try:
        if max_chars is None or len(text) <= max_chars + _MARKER_ROOM:
            return _redact_all(text)
        head = _redact_all(text[: max_chars + _SCAN_MARGIN])
        return f"{head[:max_chars]}...[truncated {len(text) - max_chars} chars]"
    except Exception:  # never expected; a report must not fail because of redaction
        return REDACTED


# === SECRETS IN STRUCTURES ===================================================================================

#: Containers nested deeper than this are replaced whole: cheaper than walking them and never leaks.
_MAX_DEPTH = 64
#: Items of one container kept; the rest is cut with a ``...[truncated N items]`` marker.
_MAX_ITEMS = 10_000
#: Values walked in one call; past it, what is left is replaced by a marker (a report must come back fast).
_MAX_VALUES = 200_000
#: Keys that name the secret whose value sits under a ``value`` key beside them (``{"name": ..., "value": ...}``).
_NAME_KEYS = frozenset({"name", "key", "id", "env", "variable", "var"})
_VALUE_KEYS = frozenset({"value", "val", "secret", "data"})
#: Objects whose ``__dict__`` is not their content: left as they are (their ``str`` is scanned as text).
_OPAQUE = (type, types.ModuleType, enum.Enum, BaseException)


class _Walk:
    """The state of one :func:`redact_secrets` call: containers being walked (cycles) and the values left."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.active: set[int] = set()
        self.left = _MAX_VALUES


def _scalar_under_secret_name(value: Any) -> Any:
    # Numbers, flags and None are not credentials (``num_key_value_heads=8``, ``use_auth=True``); anything
    # else under a secret-looking name is.
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return REDACTED


def _fields(obj: Any) -> dict[str, Any] | None:
    """The fields of a dataclass, named tuple or object with a ``__dict__``; ``None`` for anything else.

    Reads attributes without calling ``__repr__``/``__str__``; a field that cannot be read is ``<redacted>``.
    """
    if isinstance(obj, _OPAQUE) or callable(obj):
        return None  # classes, modules, functions, nn.Modules, enums, exceptions: their str is what they show
    field_names = getattr(type(obj), "_fields", None)
    if isinstance(obj, tuple) and isinstance(field_names, tuple):  # a named tuple
        return dict(zip(field_names, obj))
    names: list[str]
    if dataclasses.is_dataclass(obj):
        names = [field.name for field in dataclasses.fields(obj)]
    else:
        try:
            attributes = vars(obj)
        except TypeError:  # no __dict__ (slots, C types): str(obj) is scanned as text later
            return None
        if not isinstance(attributes, dict) or not attributes:
            return None
        names = [name for name in attributes if isinstance(name, str)]
    fields: dict[str, Any] = {}
    for name in names:
        try:
            fields[name] = getattr(obj, name)
        except Exception:  # a property or descriptor of the user's that fails: show nothing of it
            fields[name] = REDACTED
    return fields


def _secret_value_keys(mapping: dict[Any, Any]) -> bool:
    """Whether ``mapping`` is a ``{"name": "<secret name>", "value": ...}`` entry (Kubernetes env, tags, ...)."""
    return any(
        isinstance(key, str) and key.lower() in _NAME_KEYS and is_secret_name(value) for key, value in mapping.items()
    )


def _mapping(obj: Mapping[Any, Any], depth: int, walk: _Walk) -> dict[Any, Any]:
    items = list(obj.items())
    named = False
    if len(items) <= 16:
        named = _secret_value_keys(dict(items[:_MAX_ITEMS]))
    out: dict[Any, Any] = {}
    for key, value in items[:_MAX_ITEMS]:
        new_key = key
        if isinstance(key, str):
            new_key = _redact(key, depth + 1, walk)
        secret = is_secret_name(key) or (named and isinstance(key, str) and key.lower() in _VALUE_KEYS)
        if secret:
            out[new_key] = _scalar_under_secret_name(value)
        else:
            out[new_key] = _redact(value, depth + 1, walk)
    if len(items) > _MAX_ITEMS:
        out["..."] = f"[truncated {len(items) - _MAX_ITEMS} items]"
    return out


def _is_flag(item: Any) -> bool:
    return isinstance(item, str) and item.startswith("-") and "=" not in item and _is_valued_secret_flag(item)


def _sequence(items: list[Any], depth: int, walk: _Walk) -> list[Any]:
    """The items redacted; the item after a secret flag (``["--db-password", x]``) or a secret name in a pair
    (``("token", x)``) is replaced whole."""
    kept = items[:_MAX_ITEMS]
    out = [_redact(item, depth + 1, walk) for item in kept]
    pair = len(kept) == 2 and isinstance(kept[0], str) and is_secret_name(kept[0])
    for i in range(1, len(kept)):
        after_flag = _is_flag(kept[i - 1]) and not (isinstance(kept[i], str) and kept[i].startswith("--"))
        if after_flag or (pair and i == 1):
            out[i] = _scalar_under_secret_name(kept[i])
    if len(items) > _MAX_ITEMS:
        out.append(f"...[truncated {len(items) - _MAX_ITEMS} items]")
    return out


def _redact(obj: Any, depth: int, walk: _Walk) -> Any:
    walk.left -= 1
    if walk.left < 0:
        return "...[truncated: too many values]"
    if isinstance(obj, str):
        return redact_text(obj, max_chars=walk.max_chars)
    if obj is None or isinstance(obj, (bool, int, float, complex, bytes)):
        return obj
    if depth >= _MAX_DEPTH or id(obj) in walk.active:
        return REDACTED
    walk.active.add(id(obj))
    try:
        if isinstance(obj, Mapping):
            return _mapping(obj, depth, walk)
        fields = _fields(obj)
        if fields is not None:
            return _mapping(fields, depth, walk)
        if isinstance(obj, (list, tuple)):
            items = _sequence(list(obj), depth, walk)
            return items if isinstance(obj, list) else tuple(items)
        if isinstance(obj, (set, frozenset)):
            redacted = _sequence(list(obj), depth, walk)
            return frozenset(redacted) if isinstance(obj, frozenset) else set(redacted)
        return obj
    except Exception:  # an odd container that cannot be walked: leak nothing, raise nothing
        return REDACTED
    finally:
        walk.active.discard(id(obj))


def redact_secrets(obj: Any, max_chars: int = MAX_VALUE_CHARS) -> Any:
    """A copy of ``obj`` with the secrets in it replaced by ``"<redacted>"``; ``obj`` is not changed.

    Walks mappings (returned as ``dict``), lists, tuples and sets, and turns the objects that show their fields
    in their ``repr`` into a ``dict`` of those fields before anything becomes a string: dataclasses, named
    tuples, ``argparse.Namespace``, ``SimpleNamespace`` and other objects with a ``__dict__`` (the object is read,
    never rebuilt). Replaced whole (numbers, booleans and ``None`` are kept: they are settings such as
    ``num_key_value_heads``): a value under a secret name (:func:`is_secret_name`), the value after a secret flag
    in an argument list (``["--db-password", x]``), the second item of a ``("token", x)`` pair and the ``value``
    of a ``{"name": "DB_PASSWORD", "value": x}`` entry. Every other string goes through :func:`redact_text`
    and is cut to ``max_chars`` characters with a ``...[truncated N chars]`` marker; containers keep 10,000
    items. Classes, functions, modules (``nn.Module`` included), enums, tensors and other objects are returned
    as they are. A container that contains itself, or that is nested more than 64 deep, is replaced whole.
    Never raises.

    Examples:
        >>> redact_secrets({"lr": 0.1, "api_key": "sk-123", "logger": {"uri": "https://u:pw@host/x"}})
        {'lr': 0.1, 'api_key': '<redacted>', 'logger': {'uri': 'https://u:<redacted>@host/x'}}
        >>> import argparse
        >>> redact_secrets(argparse.Namespace(tokenizer="t5-small", db_password="hunter2"))
        {'tokenizer': 't5-small', 'db_password': '<redacted>'}
    """
    try:
        return _redact(obj, 0, _Walk(max_chars))
    except Exception:
        return REDACTED

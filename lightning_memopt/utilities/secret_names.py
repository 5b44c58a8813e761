"""Which names (keys, fields, variables, flags, parameters) hold a secret: whole words of the name, not substrings.

A name is split into its words at ``_``, ``-``, ``.``, spaces and camelCase boundaries (``wandbApiKey`` ->
``wandb api key``, ``AWS_SECRET_ACCESS_KEY`` -> ``aws secret access key``), and the words decide:
``api_key``, ``access_token``, ``db_password`` and ``client_secret`` are secret; ``tokenizer_name``, ``author``,
``keyframe_dir``, ``sort_key``, ``auth_mode`` and ``pad_token`` are not.
"""

from __future__ import annotations

import re
from functools import lru_cache

__all__ = ["REDACTED", "SECRET_WORDS", "is_secret_name", "name_words"]

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

    Example:
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

    Example:
        >>> [is_secret_name(n) for n in ("TORCH_HUB_TOKEN", "api_key", "clientSecret", "--db-password")]
        [True, True, True, True]
        >>> [is_secret_name(n) for n in ("NCCL_DEBUG", "tokenizer_name", "sort_key", "author", "pad_token")]
        [False, False, False, False, False]
    """
    if not isinstance(name, str):
        return False
    return _is_secret_cached(name[-_MAX_NAME_CHARS:])

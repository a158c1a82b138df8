"""MLflow credentials: one home (MLflow's own variables), and one way to mask them.

A tracking URI may carry credentials (``https://alice:s3cret@host``, ``https://tok3n@host``,
``https://host/?token=…``). No process of a run keeps them in the URI: the Kedro process
(``settings.py``) and every worker (``python -m titan_kedro.train``) call
:func:`adopt_tracking_credentials` first thing, which rewrites ``MLFLOW_TRACKING_URI``
without them and moves them to ``MLFLOW_TRACKING_USERNAME`` / ``PASSWORD`` / ``TOKEN``
(which MLflow's client reads: basic auth or a bearer token). Percent-encoded credentials
are decoded there (``p%40ss`` logs in as ``p@ss``). So no message a process prints
(MLflow's ``API request to http://…`` errors, torchrun's ``error.json``) can hold them in
URI form, and :class:`SecretFilter`, installed into every log record's creation
(:func:`install_secret_filter`), masks any known secret value and credential-looking text
in what is logged anyway.

:func:`redact` is the one masking function (also for the launcher's requests, ``appdef.json``
and echoed lines, ``launch.secrets``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import traceback
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, quote_plus, unquote, urlencode, urlsplit

from titan_kedro.storage.credentials import storage_secrets

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
USERNAME_ENV = "MLFLOW_TRACKING_USERNAME"
PASSWORD_ENV = "MLFLOW_TRACKING_PASSWORD"
TOKEN_ENV = "MLFLOW_TRACKING_TOKEN"
CREDENTIAL_ENVS = (USERNAME_ENV, PASSWORD_ENV, TOKEN_ENV)
"""MLflow's credential variables, read by its client."""
MASK = "***"
SECRET_KEY_WORDS = (
    "secret", "token", "signature", "password", "passwd", "key", "credential", "auth",
)  # fmt: skip
"""A query parameter whose name contains one of these (any case) holds a secret
(``?token=…``, ``client_secret``, ``x-api-key``, ``X-Amz-Signature``, ``private_token``)."""
SECRET_KEYS = ("sig", "pwd", "pass")
"""Short names that are secret only as a whole name."""
SECRET_VARIABLE_WORDS = ("PASSWORD", "PASSWD", "TOKEN", "SECRET", "KEY", "CREDENTIAL", "AUTH")
"""An environment variable whose name contains one of these holds a secret."""


def is_secret_key(name: str) -> bool:
    """Whether a query parameter named ``name`` holds a secret (the one rule)."""
    lowered = name.lower()
    return lowered in SECRET_KEYS or any(word in lowered for word in SECRET_KEY_WORDS)


# Plain (or JSON-escaped ``\/``) URLs: a password may hold ``@`` and ``:`` (masked up to the
# last ``@`` before the host); percent-encoded URLs (a URL inside a query): separators %3A/%40.
_PLAIN_USERINFO = re.compile(
    r"(?P<prefix>[A-Za-z][A-Za-z0-9+.-]*:(?://|\\/\\/))(?P<user>[^\s/@:'\"\\<>?#]+)"
    r"(?:(?P<colon>:)(?P<password>[^\s/'\"\\<>?#]*))?(?P<at>@|\\u0040)",
    re.IGNORECASE,
)
_ENC_CHAR = r"(?:(?!%40|%3A)[^\s/@:'\"\\<>&?#])"
_ENCODED_USERINFO = re.compile(
    rf"(?P<prefix>[A-Za-z][A-Za-z0-9+.-]*%3A%2F%2F)(?P<user>{_ENC_CHAR}+)"
    rf"(?:(?P<colon>%3A)(?P<password>{_ENC_CHAR}*))?(?P<at>%40)",
    re.IGNORECASE,
)
_KEY = r"[\w.~-]*(?:" + "|".join(SECRET_KEY_WORDS) + r")[\w.~-]*|(?:" + "|".join(SECRET_KEYS) + ")"
_QUERY = re.compile(
    rf"(?P<prefix>(?:[?&;]|%3F|%26|\\u0026)(?:{_KEY})(?:=|%3D))"
    r"(?P<value>(?:(?!%26|\\u0026)[^&\s'\"#\\])+)",
    re.IGNORECASE,
)
_VARIABLE_NAME = r"[A-Z0-9_]*(?:" + "|".join(SECRET_VARIABLE_WORDS) + r")[A-Z0-9_]*"
_SECRET_VARIABLE = re.compile(
    rf"(?P<prefix>\b{_VARIABLE_NAME}\b\\?[\"']?\s*(?:=|:)\s*\\?[\"']?)"
    r"(?P<value>[^\s'\"\\,}]+)"
)
# Kubernetes / TorchX env entries: ``name: X_TOKEN`` then ``value: …`` (YAML or a dict).
_NAMED_VALUE = re.compile(
    rf"(?P<prefix>\bname[\"']?\s*:\s*[\"']?{_VARIABLE_NAME}[\"']?,?\s*[\"']?value[\"']?\s*:\s*"
    r"[\"']?)(?P<value>[^\s'\"\\,}]+)"
)


@dataclass(frozen=True)
class TrackingSecrets:
    """The tracking URI without credentials, and the credentials taken out of it."""

    uri: str | None
    """The URI without user info or secret query parameters (None: no URI)."""
    credentials: dict[str, str] = field(default_factory=dict)
    """``MLFLOW_TRACKING_USERNAME`` / ``PASSWORD`` / ``TOKEN`` found in the URI or in the
    environment given."""

    def values(self) -> list[str]:
        """The secret values (passwords and tokens; user names are not secret)."""
        return secret_values(self.credentials)


def secret_values(credentials: Mapping[str, str]) -> list[str]:
    """The passwords and tokens among MLflow's credential variables (user names are not secret)."""
    return [v for k, v in credentials.items() if k != USERNAME_ENV and v]


def split_tracking_uri(
    uri: str | None, environ: Mapping[str, str] | None = None
) -> TrackingSecrets:
    """``uri`` without its credentials, and the credentials as MLflow's variables.

    ``user:password@`` becomes ``MLFLOW_TRACKING_USERNAME`` / ``PASSWORD`` (percent-decoded;
    a password may hold ``@``); a user part alone (``tok3n@``) and a secret query parameter
    (:func:`is_secret_key`) become ``MLFLOW_TRACKING_TOKEN``. Credentials already in
    ``environ`` (default ``os.environ``) are kept unless the URI names others.
    """
    environ = os.environ if environ is None else environ
    credentials = {k: environ[k] for k in CREDENTIAL_ENVS if environ.get(k)}
    if not uri:
        return TrackingSecrets(uri, credentials)
    parts = urlsplit(uri)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, colon, password = userinfo.partition(":")
        if colon:
            credentials.update({USERNAME_ENV: unquote(user), PASSWORD_ENV: unquote(password)})
        else:
            credentials[TOKEN_ENV] = unquote(user)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    query = []
    for key, value in pairs:
        if is_secret_key(key):
            credentials[TOKEN_ENV] = value
        else:
            query.append((key, value))
    if netloc == parts.netloc and len(query) == len(pairs):
        # Nothing secret: keep the URI as written (a rebuilt sqlite:////abs/path loses a /).
        return TrackingSecrets(uri, credentials)
    clean = parts._replace(netloc=netloc, query=urlencode(query)).geturl()
    return TrackingSecrets(clean, credentials)


_KNOWN: set[str] = set()
"""Secret values this process has seen (adopted from its tracking URI)."""


def known_secrets() -> set[str]:
    """The secret values this process knows: adopted ones, its MLflow credential variables
    and its object-storage secrets (``storage.credentials``)."""
    return {*_KNOWN, *split_tracking_uri(None).values(), *storage_secrets()}


def _encoded_forms(secret: str) -> set[str]:
    return {
        secret, unquote(secret), json.dumps(secret)[1:-1], quote(secret, safe=""),
        quote(secret), quote_plus(secret),
    }  # fmt: skip


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every credential masked; the one function for every output path.

    Masks the password of ``scheme://user:password@`` (a lone user part, a token, as a
    whole), secret query parameters (:func:`is_secret_key`), values of ``*PASSWORD*`` /
    ``*TOKEN*`` / ``*SECRET*`` / ``*KEY*`` / … variables (``NAME=value``, ``"NAME": "value"``,
    ``name: NAME`` + ``value: …``), in plain, shell-quoted, JSON-escaped and percent-encoded
    forms, and every value in ``secrets`` and :func:`known_secrets` wherever it appears
    (as written and percent-encoded or -decoded).
    """

    def _userinfo(match: re.Match[str]) -> str:
        if match["colon"] is None:
            return f"{match['prefix']}{MASK}{match['at']}"
        return f"{match['prefix']}{match['user']}{match['colon']}{MASK}{match['at']}"

    text = _PLAIN_USERINFO.sub(_userinfo, text)
    text = _ENCODED_USERINFO.sub(_userinfo, text)
    text = _QUERY.sub(lambda m: m["prefix"] + MASK, text)
    text = _SECRET_VARIABLE.sub(lambda m: m["prefix"] + MASK, text)
    text = _NAMED_VALUE.sub(lambda m: m["prefix"] + MASK, text)
    known = {*secrets, *known_secrets()}
    forms = {f for s in known if s for f in _encoded_forms(s) if len(f) > 1}
    for form in sorted(forms, key=len, reverse=True):
        text = text.replace(form, MASK)
    return text


def adopt_tracking_credentials(
    environ: MutableMapping[str, str] | None = None,
) -> TrackingSecrets:
    """Move the credentials of ``$MLFLOW_TRACKING_URI`` to MLflow's credential variables.

    ``environ`` (default ``os.environ``) keeps the URI without them; the secret values are
    remembered for :func:`redact`. Idempotent; the first call of every process of a run.
    """
    environ = os.environ if environ is None else environ
    uri = environ.get(TRACKING_URI_ENV)
    split = split_tracking_uri(uri, environ)
    if split.uri is not None and split.uri != uri:
        environ[TRACKING_URI_ENV] = split.uri
    environ.update(split.credentials)
    _KNOWN.update(split.values())
    return split


def mask_record(record: logging.LogRecord) -> logging.LogRecord:
    """``record`` with every secret masked in its message, traceback and stack."""
    try:
        message = record.getMessage()
    except Exception:  # a broken format: logging reports it itself
        return record
    masked = redact(message)
    if record.exc_info and record.exc_info[1] is not None:
        trace = "".join(traceback.format_exception(*record.exc_info))
        if redact(trace) != trace:  # fold the masked traceback into the message
            masked = f"{masked}\n{redact(trace).rstrip()}"
            record.exc_info, record.exc_text = None, None
    if masked != message:
        record.msg, record.args = masked, None
    if record.exc_text:
        record.exc_text = redact(record.exc_text)
    if record.stack_info:
        record.stack_info = redact(record.stack_info)
    return record


class SecretFilter(logging.Filter):
    """Masks every secret this process knows in each record (see :func:`mask_record`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        mask_record(record)
        return True


_INSTALLED = False


def install_secret_filter() -> None:
    """Mask every log record of this process as it is made (any logger, any handler,
    including handlers configured later). Idempotent."""
    global _INSTALLED
    if _INSTALLED:
        return
    make = logging.getLogRecordFactory()
    secret_filter = SecretFilter()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        secret_filter.filter(record)
        return record

    logging.setLogRecordFactory(factory)
    _INSTALLED = True

"""The one exception hierarchy of shardsync.

Errors are split by who is at fault, so callers can decide what to do
without parsing messages::

    ShardsyncError                  base of everything we raise on purpose
    ├── ConfigError                 the user's configuration or arguments are wrong
    ├── ManifestError               the origin's index/listing is malformed or hostile
    │   ├── UnsafeNameError         a file name that must never become a path or URL
    │   └── HeaderError             a safetensors header is malformed or disagrees with the index
    ├── OriginError                 the origin answered, and the answer is final
    │   ├── RepoNotFoundError       404 / X-Error-Code: RepoNotFound
    │   ├── RevisionNotFoundError   X-Error-Code: RevisionNotFound
    │   ├── EntryNotFoundError      X-Error-Code: EntryNotFound (a file is missing)
    │   ├── AuthError               401/403, gated or private repo, bad token
    │   └── ProtocolError           the server broke HTTP semantics (lying Content-Range, ...)
    ├── TransferError               the network kept failing until the retry budget ran out
    │   └── StalledError            a connection fell under the minimum-throughput watchdog
    ├── IntegrityError              downloaded bytes did not match their sha256/size
    ├── CacheError                  the local cache cannot be used
    │   └── DiskFullError           ENOSPC/EDQUOT while writing; partial files are kept
    ├── OfflineError                offline mode and the cache cannot answer
    ├── LoadError                   the checkpoint does not fit the model, or loading stopped
    ├── JobCancelledError           a prefetch job was cancelled (DELETE /v1/jobs/{id}, Job.cancel)
    └── DaemonError                 the daemon refused a request or broke the API
        ├── DaemonUnavailableError  no daemon answers at the socket (and fallback = "error")
        └── DaemonStoppingError     the daemon stopped while the client waited on it

Errors of the layers below (aiohttp, OSError, json) are mapped at the module
boundary with ``raise ... from exc`` so a user never sees a traceback from deep
inside a library for a condition we anticipated. Text that came from the network (an
error body, a library's message) goes into a message only through ``redact``: no signed
URL, signature or token in it reaches an output (promise 12).
"""

from __future__ import annotations

import errno
import re
from typing import NoReturn

__all__ = [
    "AuthError",
    "CacheError",
    "ConfigError",
    "DaemonError",
    "DaemonStoppingError",
    "DaemonUnavailableError",
    "DiskFullError",
    "EntryNotFoundError",
    "HeaderError",
    "IntegrityError",
    "JobCancelledError",
    "LoadError",
    "ManifestError",
    "OfflineError",
    "OriginError",
    "ProtocolError",
    "RepoNotFoundError",
    "RevisionNotFoundError",
    "ShardsyncError",
    "StalledError",
    "TransferError",
    "UnsafeNameError",
    "disk_error",
    "first_error",
    "raise_first",
    "redact",
]


class ShardsyncError(Exception):
    """Base class: every error shardsync raises on purpose derives from it."""


class ConfigError(ShardsyncError):
    """Invalid configuration, environment or command-line arguments."""


class ManifestError(ShardsyncError):
    """The origin's index or file listing is malformed or inconsistent."""


class UnsafeNameError(ManifestError):
    """A file name from the network that could escape the cache or change a URL."""


class HeaderError(ManifestError):
    """A safetensors header is malformed, hostile or disagrees with the index."""


class OriginError(ShardsyncError):
    """The origin gave a definite answer that retrying will not change."""


class RepoNotFoundError(OriginError):
    """The repository does not exist (or is private and we have no access)."""


class RevisionNotFoundError(OriginError):
    """The branch, tag or commit does not exist in the repository."""


class EntryNotFoundError(OriginError):
    """A file named by the index or listing is missing at the origin."""


class AuthError(OriginError):
    """Authentication or authorization failed (401/403, gated repository)."""


class ProtocolError(OriginError):
    """The server's answer contradicts HTTP semantics or our request."""


class TransferError(ShardsyncError):
    """A transfer kept failing until its retry budget was exhausted."""


class StalledError(TransferError):
    """A connection delivered less than the minimum throughput for too long."""


class IntegrityError(ShardsyncError):
    """Bytes did not match the expected sha256 or size; nothing was published."""


class CacheError(ShardsyncError):
    """The local cache directory cannot be read or written."""


class DiskFullError(CacheError):
    """No space left while writing; the partial file is kept for the next run."""


class OfflineError(ShardsyncError):
    """Offline mode was requested and the cache holds no complete snapshot."""


class LoadError(ShardsyncError):
    """The checkpoint does not fit the model (keys, shapes), or loading was cancelled."""


class JobCancelledError(ShardsyncError):
    """The prefetch job was cancelled before it completed; its partial files are kept."""


class DaemonError(ShardsyncError):
    """The daemon refused the request (peer credentials, bad request) or broke its API."""


class DaemonUnavailableError(DaemonError):
    """No daemon answers at the socket; raised only when the in-process fallback is off."""


class DaemonStoppingError(DaemonError):
    """The daemon is shutting down; unfinished jobs resume when it starts again."""


def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error to report from a task group: our own first, else the first leaf.

    Task groups wrap failures in ``ExceptionGroup``; users should see the one clear
    error that stopped the work, not the group.
    """
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        exc = pending.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            pending[:0] = exc.exceptions
        else:
            leaves.append(exc)
    for exc in leaves:
        if isinstance(exc, ShardsyncError):
            return exc
    return leaves[0] if leaves else group


def raise_first(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Raise ``first_error(group)`` as it was raised: its own cause stays (a ``from None``
    here would wipe the ``OSError`` under a ``CacheError``), the group is left out."""
    error = first_error(group)
    raise error from error.__cause__


KEPT = "the partial download is kept and resumes on the next run"


def disk_error(exc: OSError, action: str, *, then: str | None = None) -> CacheError:
    """The one mapping of a local file error (``action``: what failed, "write /x"): a full
    disk or quota gets its own error. Both say ``then``, what becomes of the work, when given
    (a full disk says by default that the partial download is kept)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(f"no space left on device while trying to {action}; {then or KEPT}")
    return CacheError(f"cannot {action}: {exc.strerror or exc}" + (f"; {then}" if then else ""))


_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>`]+")
_QUERY = re.compile(r"\?[^\s\"'<>`?]*=[^\s\"'<>`]*")
_CREDENTIAL = re.compile(
    r"(?i)\b(x-amz-[a-z0-9-]+|signature|credential|awsaccesskeyid|key-pair-id|policy|"
    r"token|access_token|sig)=[^&\s\"'<>`,;]*"
)
_BEARER = re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]+")
# a Basic (NTLM, Negotiate) credential however its header is quoted (a header line, JSON,
# an HTML table): base64 of 8 or more, with a digit, a capital after its first letter or
# +/= in it (so "Basic authentication required" stays as it is)
_SCHEME_TOKEN = re.compile(
    r"\b(Basic|NTLM|Negotiate)\s+(?=[A-Za-z0-9+/]*(?:[0-9+/=]|(?<=[A-Za-z0-9+/])[A-Z]))"
    r"[A-Za-z0-9+/]{8,}={0,2}"
)
_PORT = re.compile(r"[0-9]*")
_REDACTED = "[redacted]"


def redact(text: str) -> str:
    """Text that a server or a library wrote, made fit for a message (promise 12).

    A server may quote the request it refused in its error body (some stores and proxies
    do), and a library may name the URL it failed on: a signed URL's query, a
    ``Signature=``/``X-Amz-Credential=`` value or a bearer token in that text is a
    credential, and so is an ``Authorization:`` header's (``Basic``, a proxy's too). URLs
    keep their scheme, host, port and path (no userinfo, query or fragment: all before the
    last ``@`` goes, since a password may hold ``/``, ``?`` or ``#`` unencoded); a bare query
    string (``/key?X-Amz-...``) and every credential parameter lose their values. Applied
    before any truncation, so no prefix of a secret is kept.
    """

    def bare_url(match: re.Match[str]) -> str:
        scheme, _, rest = match[0].partition("://")
        authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
        if "@" in authority:
            rest = rest[len(authority.rpartition("@")[0]) + 1 :]
        elif "@" in rest and not _PORT.fullmatch(authority.partition(":")[2]):
            # "user:pa/ss@host": no port, but a password with '/', '?' or '#' unencoded
            rest = rest.rpartition("@")[2]
        return f"{scheme}://{re.split(r'[?#]', rest, maxsplit=1)[0]}"

    text = _URL.sub(bare_url, text)
    text = _QUERY.sub("?" + _REDACTED, text)
    text = _CREDENTIAL.sub(lambda m: f"{m[1]}={_REDACTED}", text)
    text = _BEARER.sub(lambda m: f"{m[1]} {_REDACTED}", text)
    return _SCHEME_TOKEN.sub(lambda m: f"{m[1]} {_REDACTED}", text)

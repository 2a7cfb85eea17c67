"""
The errors of a fetch, and what each says about retrying.
DownloadError and its kinds (a bad file, give up, not there, retry later), a store's errors (its
package missing, a call failed), and the rule that a host that does not resolve stops the run
unless it has answered before.

May import: requests, urllib3.
"""

import errno
import socket
import urllib.parse

import requests
import urllib3



class DownloadError(Exception):
    """A file could not be fetched. `reason` is a short category for the end-of-run summary
    ("HTTP 404", "too slow", ...); the message says what happened in full."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class BadFileError(DownloadError):
    """A file on disk failed a check (size, sha256, magic, metadata). Partial files that fail are
    discarded."""


class HostNotFoundError(OSError):
    """The server's name does not resolve: no file can be fetched, so the whole run stops."""


class GiveUp(DownloadError):
    """Retrying cannot help in this run (404, a symlink in the way, the deadline)."""


class NotThere(GiveUp):
    """The source has no such file, or refuses it (404, another 4xx, a store's not found or access
    denied): a rerun gets the same answer, so the summary does not advise one."""


class RetryLater(DownloadError):
    """The server asked us to wait (429/503 with Retry-After) instead of using our backoff."""

    def __init__(self, reason: str, message: str, seconds: float):
        super().__init__(reason, message)
        self.seconds = seconds


class MissingExtra(ImportError):
    """A store's package is not installed: the message is one line with the pip install."""


class StoreError(OSError):
    """A store call failed. reason: a short category for summaries ("not found", "slow down");
    retry: whether trying again can help."""

    def __init__(self, reason: str, message: str, retry: bool):
        super().__init__(message)
        self.reason, self.retry = reason, retry

    def __str__(self):
        return self.args[0]


class Stopped(Exception):
    """Another file of the run hit an error that stops the run (or the user pressed Ctrl-C)."""


# -----------------------------------------------------------------------------
# A host that does not resolve: it stops the run, unless it has answered before

# Hosts that have answered in this process: a failed lookup of one of them later (a resolver's
# hiccup in a long run) is retried like any network error, not a reason to stop every download.
_ANSWERED_HOSTS: set = set()


def note_answered(response: requests.Response) -> None:
    """Every host on response's redirect chain answered: a later failed lookup of one is a
    hiccup."""
    _ANSWERED_HOSTS.update(urllib.parse.urlsplit(r.url).hostname
                           for r in [*response.history, response])


def unresolved_host(error: Exception, url: str, *,
                    even_if_answered: bool = False) -> HostNotFoundError | None:
    """The HostNotFoundError to raise when error was caused by a failed DNS lookup of a host that
    has not answered in this process (even_if_answered: of any host); None otherwise. After a
    redirect, the host is the target's."""
    failed, gaierror = _failed_url(error, url), _dns_failure(error)
    if gaierror is None or (not even_if_answered
                            and urllib.parse.urlsplit(failed).hostname in _ANSWERED_HOSTS):
        return None
    return _host_not_found(failed, gaierror)


def _dns_failure(error: BaseException) -> socket.gaierror | None:
    """The failed DNS lookup (socket.gaierror) somewhere in the error's chain, if that was the
    cause. requests wraps it: ConnectionError <- urllib3's MaxRetryError <- NameResolutionError <-
    gaierror."""
    seen = set()  # a chain can loop (an error set as its own context's cause)
    while error is not None and id(error) not in seen:
        if isinstance(error, socket.gaierror):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _failed_url(error: Exception, url: str) -> str:
    """The URL of the request that failed: after a redirect, the target's, not the one we asked
    for."""
    request = getattr(error, "request", None)
    return getattr(request, "url", None) or url


def _host_not_found(url: str, error: socket.gaierror) -> HostNotFoundError:
    host = urllib.parse.urlsplit(url).hostname
    return HostNotFoundError(f"cannot resolve the host {host!r} of {url} ({error.strerror}); check "
                             "the network connection and the URL (--base-url, NANOCHAT_DATA_URL), "
                             "then rerun (files already fetched are kept)")


# -----------------------------------------------------------------------------
# What the end-of-run summary calls an error


def reason_of(error: Exception) -> str:
    """The summary category of a network or local error."""
    if isinstance(error, (requests.Timeout, urllib3.exceptions.TimeoutError, socket.timeout)):
        return "timed out"
    if isinstance(error, (requests.RequestException, urllib3.exceptions.HTTPError)):
        return "connection failed"
    return "local error"


class DiskFull(OSError):
    """A write of a download found the disk full; `size`: the file's size, as the server stated
    it (None: it did not)."""

    def __init__(self, size: int | None):
        super().__init__(errno.ENOSPC, "no space left on the device")
        self.size = size

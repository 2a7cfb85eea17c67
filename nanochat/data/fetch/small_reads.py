"""
Small reads of a source, bounded and retried as a download is.
A file's last bytes (the footer of a shard a streaming loader has not fetched yet), and a small
file whole (a server's listing).

Imported only when needed: nanochat.data.fetch.store_transport (a store's file; fsspec with it).
May import: nanochat.data.fetch.address, nanochat.data.fetch.errors,
nanochat.data.fetch.http_transport, nanochat.data.fetch.limits, nanochat.data.fetch.store_transport,
requests, urllib3.
"""

import logging
import time

import requests
import urllib3

from nanochat.data.fetch.address import check_address, is_http, redact
from nanochat.data.fetch.errors import (DownloadError, GiveUp, RetryLater, StoreError, reason_of,
                                        unresolved_host)
from nanochat.data.fetch.http_transport import small_attempt, tail_attempt
from nanochat.data.fetch.limits import Limits

logger = logging.getLogger(__name__)

# one request holds the footer of a ~100MB hosted shard (~20 KB) with room to spare
TAIL_BYTES = 64 * 1024


def fetch_tail(url: str, nbytes: int, limits: Limits | None = None) -> tuple[int, bytes]:
    """(the file's size, its last min(nbytes, size) bytes) by one HTTP Range request (a store: a
    stat and one ranged read), bounded and retried by the rules of a file (limits: attempts,
    backoff, timeout, min_rate, deadline for all attempts together). Raises DownloadError naming
    the URL when it keeps failing or the server ignores Range, HostNotFoundError when the host does
    not resolve (a store: StoreError without credentials, MissingExtra without its package)."""
    if is_http(url):
        attempt = tail_attempt
    else:  # (late: a loader that never reads a store never loads its transport)
        from nanochat.data.fetch.store_transport import object_tail_attempt as attempt
    return _retried(url, limits, "reading the end of",
                    lambda limits, deadline: attempt(url, nbytes, limits, deadline))


def fetch_small(url: str, max_bytes: int, limits: Limits | None = None) -> bytes | None:
    """A small file whole (a listing), by one GET bounded and retried as fetch_tail's; None when
    the server has no such file (HTTP 404, or 403 and 410, which S3-like stores answer for a
    missing key). Raises DownloadError naming the URL past max_bytes or when it keeps failing.
    HTTP only: a store lists its files (stores.list_names)."""
    if isinstance(url, str) and not is_http(url):
        raise ValueError(f"fetch_small reads http(s) URLs only, not {url!r}: a store's files are "
                         "listed with stores.list_names")
    return _retried(url, limits, "reading",
                    lambda limits, deadline: small_attempt(url, max_bytes, limits, deadline))


def _retried(url: str, limits: Limits | None, doing: str, attempt_once):
    """attempt_once(limits, deadline), retried by the rules of a file; `doing` names the work in
    the messages ("reading the end of" URL)."""
    check_address(url)
    limits = Limits() if limits is None else limits
    deadline = time.monotonic() + limits.deadline
    shown = url if is_http(url) else redact(url)  # (a store's address: no secret)
    attempt = 1
    while True:
        wait = limits.backoff_base * 2 ** (attempt - 1)
        try:
            return attempt_once(limits, deadline)
        except (GiveUp, StoreError):  # (StoreError: missing credentials)
            raise
        except RetryLater as e:
            error, wait = e, e.seconds
        except DownloadError as e:
            error = e
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
            host = unresolved_host(e, url)
            if host is not None:
                raise host from None
            error = DownloadError(reason_of(e), f"{url}: {e}")
        if attempt == limits.max_attempts or time.monotonic() + wait > deadline:
            raise DownloadError(error.reason, f"{error}; gave up {doing} {shown} after "
                                              f"{attempt} attempt{'s' if attempt > 1 else ''}")
        logger.warning("%s %s, attempt %d/%d: %s; retrying in %gs", doing, shown, attempt,
                       limits.max_attempts, error, wait)
        time.sleep(wait)
        attempt += 1

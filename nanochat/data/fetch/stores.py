"""
Reading shards where they live: s3://, gs://, az://, hf://, file:// or a local directory.
An http(s) URL goes through http_transport.py; this module reads the others (address.py names their
forms) through fsspec and each store's package (the extras s3, gcs, azure, hf): stat (size,
version, the hashes the store states), read_range, list_names. Every call is bounded (timeout);
retrying is the caller's. A store's error becomes a StoreError that says whether a retry can help;
its message never holds a credential.
Credentials come from each store's own chain (environment, config files, instance roles).

Imported only when needed: fsspec, fsspec.asyn, fsspec.implementations.local, and the store's
package (s3fs, gcsfs, adlfs, huggingface_hub).
May import: nanochat.data.fetch.address, nanochat.data.fetch.errors.
"""

import base64
import importlib
import logging
import os
import re
import threading
from dataclasses import dataclass, field

from nanochat.data.fetch.address import Store, path_in_store, redact, store_of
from nanochat.data.fetch.errors import MissingExtra, StoreError


@dataclass(frozen=True)
class ObjectInfo:
    """What the store says of one object. version changes when the object is replaced (S3's ETag,
    GCS's generation, ...); hashes: {"md5" | "sha256" | "sha1": hex, "crc32" | "crc32c": int} of
    the whole object, only those the store states."""
    size: int
    version: str | None
    hashes: dict = field(default_factory=dict)


# -----------------------------------------------------------------------------
# Filesystems: one per (store, timeout), made on first use

_FILESYSTEMS: dict = {}
_FILESYSTEMS_LOCK = threading.Lock()


def _import(store: Store):
    try:
        return importlib.import_module(store.package)
    except ImportError:
        raise MissingExtra(f"{store.name} addresses need the package {store.package}: "
                           f"{store.install_hint()}") from None


def filesystem(address: str, timeout: float):
    """The fsspec filesystem for address's store. S3's makes one request a call (s3fs's and
    botocore's retries off: the caller retries with its backoff and logs each try); GCS's, Azure's
    and the hub's clients may retry within a call, which the call's bound still ends."""
    store = store_of(address)
    # a forked process makes its own: a client's connections and event loop stay with its parent
    key = (store.protocol, timeout, os.getpid())
    with _FILESYSTEMS_LOCK:  # (download threads start together: one client, not four)
        if key not in _FILESYSTEMS:
            _FILESYSTEMS[key] = _make_filesystem(store, timeout)
        return _FILESYSTEMS[key]


def _make_filesystem(store: Store, timeout: float):
    _import(store)
    fsspec = importlib.import_module("fsspec")
    options = {"use_listings_cache": False}  # a listing or a version is always asked afresh
    if store.protocol == "s3":  # botocore's timeouts and one attempt per call
        options["config_kwargs"] = {"connect_timeout": timeout, "read_timeout": timeout,
                                    "retries": {"total_max_attempts": 1}}
    fs = fsspec.filesystem(store.protocol, skip_instance_cache=True, **options)
    if store.protocol == "s3":
        fs.retries = 1  # s3fs's own retry loop: one try
    return fs


def quiet_clients() -> None:
    """The stores' clients log at INFO ("Found credentials in environment variables"): a command
    line's INFO shows ours, theirs from WARNING."""
    for name in ("botocore", "aiobotocore", "s3fs", "gcsfs", "adlfs", "azure", "huggingface_hub",
                 "fsspec"):
        logging.getLogger(name).setLevel(logging.WARNING)


def forget_filesystems() -> None:
    """Drop the filesystems made so far: the next call reads the environment (endpoint,
    credentials) afresh."""
    _FILESYSTEMS.clear()


def _call(fs, method: str, *args, timeout: float, **kwargs):
    """fs.method(*args, **kwargs) within timeout seconds. fsspec's async filesystems (S3, GCS,
    Azure) take the bound as an argument; a synchronous client over the network (the hub's) is
    awaited on a thread; local files answer at once."""
    if isinstance(fs, importlib.import_module("fsspec.asyn").AsyncFileSystem):
        return getattr(fs, method)(*args, timeout=timeout, **kwargs)
    if isinstance(fs, importlib.import_module("fsspec.implementations.local").LocalFileSystem):
        return getattr(fs, method)(*args, **kwargs)
    return _within(lambda: getattr(fs, method)(*args, **kwargs), timeout)


def _within(work, seconds: float):
    """work() awaited at most seconds, on a daemon thread; past them TimeoutError, and the thread
    is left to end by itself (its client's own timeouts end it)."""
    result = {}

    def run():
        try:
            result["value"] = work()
        except BaseException as e:  # handed to the caller, whatever it is
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True, name="nanochat-store-call")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer in {seconds:g}s")
    if "error" in result:
        raise result["error"]
    return result["value"]


# -----------------------------------------------------------------------------
# Errors: what happened, whether a retry can help, and never a credential

THROTTLED = ("SlowDown", "reduce your request rate", "Throttl", "TooManyRequests", "429", "503")


def store_error(error: BaseException, address: str) -> StoreError:
    """The StoreError for a store's exception: its category, whether to retry, and a redacted
    message that names the address and the fix."""
    store, kinds = store_of(address), {cls.__name__ for cls in type(error).__mro__}
    said, address = redact(f"{type(error).__name__}: {error}"), redact(address)
    if isinstance(error, StoreError):
        return error
    if any("Credential" in kind for kind in kinds):  # botocore, google.auth, azure
        return StoreError("no credentials",
                          f"{address}: no {store.name} credentials were found ({said}); set them "
                          f"as {store.name}'s own tools expect: {store.credentials}", False)
    if isinstance(error, FileNotFoundError):
        return StoreError("not found", f"{address}: not found in {store.name}; check the bucket "
                                       "and the prefix (--base-url, NANOCHAT_DATA_URL)", False)
    if isinstance(error, PermissionError):
        return StoreError("access denied", f"{address}: access denied by {store.name} ({said}); "
                                           "check the credentials' rights on it", False)
    if any(word in said for word in THROTTLED) or getattr(error, "errno", None) == 16:  # EBUSY
        return StoreError("slow down", f"{address}: {store.name} asks to slow down ({said})", True)
    if kinds & {"FSTimeoutError", "TimeoutError", "ReadTimeoutError", "ConnectTimeoutError"}:
        return StoreError("timed out", f"{address}: {said}", True)
    return StoreError("connection failed", f"{address}: {said}", True)


def _guarded(address: str, work):
    """work() with every store error (not a missing extra) turned into a StoreError."""
    try:
        return work()
    except MissingExtra:
        raise
    except Exception as e:
        raise store_error(e, address) from None


# -----------------------------------------------------------------------------
# Calls


def _b64_hex(value) -> str | None:
    """The hex of a base64 digest; None for anything else (a composite checksum ends in -N)."""
    try:
        return base64.b64decode(value, validate=True).hex()
    except (ValueError, TypeError):
        return None


def stated_hashes(protocol: str, info: dict) -> dict:
    """The whole-object hashes in an fsspec info dict (or S3's HeadObject answer), by store.
    S3: the ETag of a single-part object is its md5 (a multipart one ends in -N: no hash); its
    FULL_OBJECT checksums. GCS: md5Hash, crc32c. Azure: content_md5. The hub: an LFS file's
    sha256."""
    hashes = {}
    if protocol == "s3":
        etag = str(info.get("ETag", "")).strip('"')
        # encrypted with KMS or a customer's key, even a single-part object's ETag is no md5
        encrypted = (str(info.get("ServerSideEncryption", "")).startswith("aws:kms")
                     or info.get("SSECustomerAlgorithm"))
        if re.fullmatch(r"[0-9a-f]{32}", etag) and not encrypted:
            hashes["md5"] = etag
        if info.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT":  # COMPOSITE: of parts
            for name in ("CRC32", "CRC32C", "CRC64NVME", "SHA1", "SHA256"):
                value = _b64_hex(info.get(f"Checksum{name}")) if info.get(f"Checksum{name}") \
                    else None
                if value is not None:
                    hashes[name.lower()] = int(value, 16) if name.startswith("CRC") else value
    elif protocol == "gcs":
        if info.get("md5Hash"):
            hashes["md5"] = _b64_hex(info["md5Hash"])
        if info.get("crc32c"):
            hashes["crc32c"] = int(_b64_hex(info["crc32c"]), 16)
    elif protocol in ("az", "abfs"):
        md5 = (info.get("content_settings") or {}).get("content_md5")
        if md5:
            hashes["md5"] = bytes(md5).hex()
    elif protocol == "hf":
        sha256 = (info.get("lfs") or {}).get("sha256")
        if sha256:
            hashes["sha256"] = sha256
    return {name: value for name, value in hashes.items() if value is not None}


def _version(protocol: str, info: dict) -> str | None:
    """What changes when the object is replaced."""
    if protocol == "s3":  # (a bucket with versioning suspended states VersionId "null")
        return f"ETag:{info.get('ETag')}:VersionId:{info.get('VersionId')}"
    for key in ("generation", "etag", "blob_id"):
        if info.get(key):
            return f"{key}:{info[key]}"
    if protocol == "hf" and (info.get("lfs") or {}).get("sha256"):
        return f"sha256:{info['lfs']['sha256']}"
    if info.get("mtime") is not None:  # a local file: its modification time and size
        return f"mtime:{info['mtime']}:{info.get('size')}"
    return None


def stat(address: str, timeout: float, *, within: float | None = None) -> ObjectInfo:
    """Size, version and stated hashes of the object at address (StoreError: "not found", ...).
    timeout bounds each wait for the store; within (default: timeout) the whole call."""
    path, protocol = path_in_store(address), store_of(address).protocol
    within = timeout if within is None else within

    def work():
        fs = filesystem(address, timeout)  # (inside: a client that cannot be made says why)
        if protocol == "s3" and "/" in path:  # HeadObject states the checksums only when asked
            bucket, key = path.split("/", 1)
            head = _call(fs, "call_s3", "head_object", Bucket=bucket, Key=key,
                         ChecksumMode="ENABLED", timeout=within)
            return head | {"size": head["ContentLength"]}
        info = _call(fs, "info", path, timeout=within)
        if info.get("type") == "directory":
            raise FileNotFoundError(path)
        return info

    info = _guarded(address, work)
    return ObjectInfo(int(info["size"]), _version(protocol, info), stated_hashes(protocol, info))


def read_range(address: str, start: int, end: int, timeout: float, *,
               within: float | None = None) -> bytes:
    """Bytes [start, end) of the object at address. timeout bounds each wait for the store (the
    filesystem is made once per timeout); within (default: timeout) the whole call, which a large
    range at a low rate may need to be longer."""
    within = timeout if within is None else within
    return _guarded(address, lambda: _call(filesystem(address, timeout), "cat_file",
                                           path_in_store(address), start=start, end=end,
                                           timeout=within))


def list_names(base: str, timeout: float) -> list[str]:
    """The sorted names of the parquet files directly under base (StoreError "not found" when
    base holds none or does not exist)."""
    def work():
        entries = _call(filesystem(base, timeout), "ls", path_in_store(base), detail=True,
                        timeout=timeout)
        return sorted(os.path.basename(e["name"].rstrip("/")) for e in entries
                      if e.get("type") != "directory" and e["name"].endswith(".parquet"))

    names = _guarded(base, work)
    if not names:
        raise StoreError("not found", f"{redact(base)} holds no .parquet files; check the bucket "
                                      "and the prefix (--base-url, NANOCHAT_DATA_URL)", False)
    return names

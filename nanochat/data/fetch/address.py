"""
An address's forms: an http(s) URL or a store's, its parts, its checks, and how messages show it.
The stores it may name (s3://, gs://, az://, hf://, file:// or a local directory) with the package
and extra each needs; an address refused before any request; a message's address without a
password or a secret of the environment; and a local directory as the source checked apart from
the copies made of it. No store's package and no fsspec: reading a store is stores.py's.

Cost: string work; a local source costs a stat or two.

May import: nothing of ours.
"""

import os
import re
import urllib.parse
from dataclasses import dataclass


PACKAGE = "nanochat-data"  # what `pip install` names


@dataclass(frozen=True)
class Store:
    """A kind of address: fsspec's protocol for it, the package that implements it, our extra."""
    name: str  # for messages: "S3", "GCS", ...
    protocol: str
    package: str
    extra: str | None  # None: nothing to install
    credentials: str = ""  # where its own tools look for credentials

    def install_hint(self) -> str:
        return f"pip install '{PACKAGE}[{self.extra}]'"


_S3 = Store("S3", "s3", "s3fs", "s3", "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "~/.aws/credentials (AWS_PROFILE) or an instance role; AWS_ENDPOINT_URL for another "
            "S3-compatible service")
_GCS = Store("GCS", "gcs", "gcsfs", "gcs", "`gcloud auth application-default login`, "
             "GOOGLE_APPLICATION_CREDENTIALS or the instance's service account")
_AZURE = "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or a SAS token, or `az login`"
STORES = {"s3": _S3, "gs": _GCS, "gcs": _GCS,
          "az": Store("Azure", "az", "adlfs", "azure", _AZURE),
          "abfs": Store("Azure", "abfs", "adlfs", "azure", _AZURE),
          "hf": Store("the Hugging Face hub", "hf", "huggingface_hub", "hf",
                      "HF_TOKEN or `hf auth login`"),
          "file": Store("a local directory", "file", "fsspec", None)}
LOCAL = STORES["file"]
ADDRESS_FORMS = ("https://..., s3://bucket/prefix, gs://bucket/prefix, az://container/prefix, "
                 "hf://datasets/owner/name/folder, file:///path or a local directory")


# -----------------------------------------------------------------------------
# An address's parts


def scheme_of(address: str) -> str:
    """"http", "https", a key of STORES, or "" for a local path."""
    match = re.match(r"([a-zA-Z][a-zA-Z0-9+.-]*)://", address)
    return match.group(1).lower() if match else ""


def is_http(address: str) -> bool:
    return scheme_of(address) in ("http", "https")


def store_of(address: str) -> Store:
    """The Store of a non-HTTP address (a local path is file://). ValueError for other schemes."""
    scheme = scheme_of(address)
    if scheme == "":
        return LOCAL
    if scheme not in STORES:
        raise ValueError(f"unknown address {address!r}: use {ADDRESS_FORMS}; fix --base-url or "
                         "NANOCHAT_DATA_URL")
    return STORES[scheme]


def path_in_store(address: str) -> str:
    """The path fsspec's filesystem takes: s3://bucket/key -> bucket/key; a local path or file://
    -> its absolute path."""
    scheme = scheme_of(address)
    if scheme in ("", "file"):
        path = urllib.parse.unquote(address[len("file://"):]) if scheme else address
        return os.path.abspath(os.path.expanduser(path))
    return address[len(scheme) + 3:].rstrip("/")


def join(base: str, name: str) -> str:
    """base/name: a URL quotes the name, a store's path does not."""
    return f"{base.rstrip('/')}/{urllib.parse.quote(name) if is_http(base) else name}"


def is_local(address: str) -> bool:
    return store_of(address) is LOCAL if not is_http(address) else False


# -----------------------------------------------------------------------------
# A bad address: refused before any request


def check_url(url: str) -> None:
    """Raise ValueError unless url is an http:// or https:// URL with a host."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"download URL {url!r} must start with http:// or https:// and name a "
                         "host, e.g. https://huggingface.co/datasets/...; fix --base-url or "
                         "NANOCHAT_DATA_URL")


def check_address(address: str) -> None:
    """Raise ValueError unless address is an http(s) URL with a host (check_url) or a store's
    address (check_store_address: s3://bucket/prefix, ..., file://..., a local path)."""
    if not isinstance(address, str) or is_http(address):
        return check_url(address)
    if scheme_of(address) and scheme_of(address) not in STORES:
        netloc = urllib.parse.urlsplit(address).netloc  # (shown without a user:password@)
        shown = redact(address.replace(netloc, netloc.rsplit("@", 1)[-1], 1))
        raise ValueError(f"base_url {shown!r} must start with http:// or https:// or be a store's "
                         f"address: {ADDRESS_FORMS}; fix --base-url or NANOCHAT_DATA_URL")
    check_store_address(address)


def check_store_address(address: str) -> None:
    """Raise ValueError unless address has one of the accepted forms (an http(s) URL with a host,
    a store's scheme with a bucket or repository, or a local path)."""
    if not isinstance(address, str) or not address:
        raise ValueError(f"address {address!r} must be a non-empty string: {ADDRESS_FORMS}")
    scheme = scheme_of(address)
    if scheme in ("http", "https"):
        if not urllib.parse.urlsplit(address).netloc:
            raise ValueError(f"URL {address!r} names no host; fix --base-url or "
                             "NANOCHAT_DATA_URL")
        return
    store = store_of(address)
    if scheme == "file" and not address[len("file://"):].strip("/"):
        raise ValueError(f"{address!r} names no directory, e.g. file:///data/shards; fix "
                         "--base-url or NANOCHAT_DATA_URL")
    if scheme == "hf" and len(address[len("hf://"):].strip("/").split("/")) < (
            3 if address[len("hf://"):].startswith(("datasets/", "spaces/")) else 2):
        raise ValueError(f"{address!r} names no repository of the Hugging Face hub, e.g. "
                         "hf://datasets/owner/name/folder; fix --base-url or NANOCHAT_DATA_URL")
    if scheme and scheme != "file" and not address[len(scheme) + 3:].strip("/"):
        example = ("hf://datasets/owner/name/folder" if scheme == "hf"
                   else f"{scheme}://bucket/prefix")
        raise ValueError(f"{address!r} names no bucket or repository of {store.name}, e.g. "
                         f"{example}; fix --base-url or NANOCHAT_DATA_URL")


# -----------------------------------------------------------------------------
# An address as messages show it: never a secret


# environment variables whose values are secrets: never shown, whatever a store's message holds
_SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL|SAS|CONNECTION_STRING")
# values that name no secret, whatever the variable (TOKENIZERS_PARALLELISM=false)
_PLAIN_VALUES = {"true", "false", "yes", "no", "on", "off", "none", "null"}


def redact(text: str) -> str:
    """text with the value of every secret-looking environment variable replaced by ***."""
    for name, value in os.environ.items():
        if (_SECRET_NAME.search(name.upper()) and len(value) >= 4
                and value.lower() not in _PLAIN_VALUES and not value.isdigit()):
            text = text.replace(value, "***")
    return text


# -----------------------------------------------------------------------------
# A source's address shown, and a local source checked


def shown(address: str) -> str:
    """address as messages show it: without a URL's user:password@, and no secret of the
    environment in it."""
    parts = urllib.parse.urlsplit(address)
    if "@" in parts.netloc:
        address = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
    return redact(address)


def check_source(base_url: str, data_dir: str) -> None:
    """check_address, and for a local directory as the source, that it is one, and that data_dir
    (the copies, the cache) is another directory, not inside it: nothing is ever written to or
    deleted from the source."""
    check_address(base_url)
    if not is_local(base_url):
        return
    named = path_in_store(base_url)
    if not os.path.isdir(named):  # most often a URL without its scheme
        raise ValueError(f"base_url {shown(base_url)!r} is not a directory here; a URL must start "
                         f"with http:// or https:// (forms: {ADDRESS_FORMS}); fix "
                         "--base-url or NANOCHAT_DATA_URL")
    source = os.path.realpath(named)
    target = os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(data_dir))))
    if target == source or target.startswith(source.rstrip(os.sep) + os.sep):
        raise ValueError(
            f"data_dir {data_dir} is {'the' if target == source else 'inside the'} source "
            f"directory {named} (base_url): the shards are copied from it into data_dir, and "
            "nothing may be written into the source; pass a data_dir outside it, e.g. "
            f"{named.rstrip(os.sep)}_cache")

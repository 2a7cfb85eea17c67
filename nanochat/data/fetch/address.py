"""
A source's address as messages show it, and the check of a local source.
A source's address as messages show it (no password, no secret of the environment), and the check
that a local directory as the source is one, and apart from the copies made of it.

Cost: string work; a local source costs a stat or two.

May import: nanochat.data.fetch.errors, nanochat.data.fetch.stores.
"""

import os
import urllib.parse

from nanochat.data.fetch import stores
from nanochat.data.fetch.errors import check_address


def shown(address: str) -> str:
    """address as messages show it: without a URL's user:password@, and no secret of the
    environment in it."""
    parts = urllib.parse.urlsplit(address)
    if "@" in parts.netloc:
        address = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
    return stores.redact(address)


def check_source(base_url: str, data_dir: str) -> None:
    """check_address, and for a local directory as the source, that it is one, and that data_dir
    (the copies, the cache) is another directory, not inside it: nothing is ever written to or
    deleted from the source."""
    check_address(base_url)
    if not stores.is_local(base_url):
        return
    named = stores.path_in_store(base_url)
    if not os.path.isdir(named):  # most often a URL without its scheme
        raise ValueError(f"base_url {shown(base_url)!r} is not a directory here; a URL must start "
                         f"with http:// or https:// (forms: {stores.ADDRESS_FORMS}); fix "
                         "--base-url or NANOCHAT_DATA_URL")
    source = os.path.realpath(named)
    target = os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(data_dir))))
    if target == source or target.startswith(source.rstrip(os.sep) + os.sep):
        raise ValueError(
            f"data_dir {data_dir} is {'the' if target == source else 'inside the'} source "
            f"directory {named} (base_url): the shards are copied from it into data_dir, and "
            "nothing may be written into the source; pass a data_dir outside it, e.g. "
            f"{named.rstrip(os.sep)}_cache")

"""
A shard server: a directory's `*.parquet` shards over HTTP, served the way the hub serves them.
It answers Range requests (what a streaming loader reads footers with, and what resumes a broken
download), its ETag is the body's quoted sha256, and a rate limit may be shared by all connections.
It also answers `index.json`: the shards and their sizes, made on each request (the directory's own
index.json, when it has one). Any other name is a 404: other files in the directory are never
served. The demo, the benchmarks and the tests use it; `python -m nanochat.dataset serve DIR` runs
it (main below).

    server = ShardServer(directory, rate=50e6)   # on 127.0.0.1, a free port, a daemon thread
    server.url, server.gets                      # http://127.0.0.1:PORT, [(name, Range or None)]
    server.close()                               # gone: later connections are refused

Design: docs/streaming.md#your-own-shards

May import: nanochat.data.base.layout.
"""

import argparse
import hashlib
import io
import json
import os
import re
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from nanochat.data.base.layout import LISTING

BLOCK = 64 * 1024  # bytes written at a time (and the rate limiter's step)


def servable(name: str) -> bool:
    """Whether a name is one the server answers for: a shard (`*.parquet`) or the listing, as a
    plain file name. Nothing outside the directory, and nothing else in it (notes, keys)."""
    return (name.endswith(".parquet") or name == LISTING) and "/" not in name and "\\" not in name


def directory_listing(directory: str) -> dict:
    """The listing of a directory's shards: its `*.parquet` files, sorted by name, with their
    bytes. (The loaders' split of it: val is the last name, train the others.)"""
    names = sorted(name for name in os.listdir(directory) if name.endswith(".parquet")
                   and os.path.isfile(os.path.join(directory, name)))
    return {"files": [{"name": name, "size": os.path.getsize(os.path.join(directory, name))}
                      for name in names]}


class Throttle:
    """A link of `rate` bytes/s shared by every connection: each block waits for its turn."""

    def __init__(self, rate: float | None):
        self.rate, self.free_at, self.lock = rate, time.monotonic(), threading.Lock()

    def take(self, nbytes: int) -> None:
        if not self.rate:
            return
        with self.lock:
            now = time.monotonic()
            # the link is busy until free_at: this block goes after the ones booked before it
            self.free_at = max(self.free_at, now) + nbytes / self.rate
            wait = self.free_at - now - nbytes / self.rate  # until this block's turn starts
        if wait > 0:
            time.sleep(wait)


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format, *args):
        pass  # quiet: the tests' output stays readable; the server keeps its own log (gets)

    def _name(self) -> str:
        # %-escapes undone: a name with a space arrives as %20
        return urllib.parse.unquote(urllib.parse.urlsplit(self.path).path.rsplit("/", 1)[-1])

    def _body(self) -> tuple[int, str, io.BufferedIOBase] | None:
        """(size, ETag, an open file) of what the request names, or None when there is nothing."""
        name = self._name()
        if not servable(name):
            return None
        path = os.path.join(self.server.directory, name)
        if os.path.isfile(path):  # (a symlinked shard is followed)
            return os.path.getsize(path), self.server.etag(path), open(path, "rb")
        if name == LISTING:  # none in the directory: made now, so it is never out of date
            body = json.dumps(directory_listing(self.server.directory)).encode()
            return len(body), hashlib.sha256(body).hexdigest(), io.BytesIO(body)
        return None

    def _headers(self, code: int, length: int, etag: str,
                 content_range: str | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{etag}"')
        if content_range:
            self.send_header("Content-Range", content_range)
        self.end_headers()

    def do_HEAD(self):
        body = self._body()
        if body is None:
            self.send_error(404)
            return
        size, etag, f = body
        f.close()
        self._headers(200, size, etag)

    def do_GET(self):
        body, wanted = self._body(), self.headers.get("Range")
        with self.server.lock:
            self.server.gets.append((self._name(), wanted))
        if body is None:
            self.send_error(404)
            return
        size, etag, f = body
        # the listing, a few hundred bytes, is not held back: the rate is the shards' link
        throttle = self.server.throttle if self._name() != LISTING else Throttle(None)
        with f:
            first, last = 0, size - 1
            match = re.fullmatch(r"bytes=(\d*)-(\d*)", (wanted or "").strip())
            if_range = self.headers.get("If-Range")
            # If-Range naming another version: the whole file, as the hub answers
            if match and (if_range is None or if_range == f'"{etag}"'):
                if match.group(1):  # bytes=first- or bytes=first-last
                    first = int(match.group(1))
                    last = min(int(match.group(2) or size - 1), size - 1)
                elif match.group(2):  # bytes=-n: the last n bytes
                    first = max(size - int(match.group(2)), 0)
                if first > last:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self._headers(206, last - first + 1, etag, f"bytes {first}-{last}/{size}")
            else:
                self._headers(200, size, etag)
            f.seek(first)
            left = last - first + 1
            while left > 0:
                block = f.read(min(BLOCK, left))
                throttle.take(len(block))
                try:
                    self.wfile.write(block)
                except (BrokenPipeError, ConnectionResetError):  # the client hung up
                    return
                left -= len(block)


class ShardServer(ThreadingHTTPServer):
    daemon_threads = True  # a connection still open never keeps a test process alive

    def __init__(self, directory: str, rate: float | None = None, *, host: str = "127.0.0.1",
                 port: int = 0):
        super().__init__((host, port), _Handler)  # port 0: a free port, chosen by the kernel
        self.directory, self.throttle = directory, Throttle(rate)
        self.gets: list[tuple[str, str | None]] = []
        self.etags: dict[tuple, str] = {}  # (path, size, mtime_ns) -> sha256
        self.lock = threading.Lock()
        # (a URL names the host to reach: 0.0.0.0 listens everywhere, and is reached here)
        shown = "127.0.0.1" if host in ("", "0.0.0.0") else host
        shown = f"[{shown}]" if ":" in shown else shown  # an IPv6 address in a URL
        self.url = f"http://{shown}:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, name="shard-server", daemon=True).start()

    def etag(self, path: str) -> str:
        """The file's sha256, hashed once per version: a file is served many times, and one
        replaced while serving (another size or mtime) gets its new hash."""
        stat = os.stat(path)
        version = (path, stat.st_size, stat.st_mtime_ns)
        with self.lock:
            if version not in self.etags:
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    while block := f.read(1 << 20):
                        h.update(block)
                self.etags[version] = h.hexdigest()
            return self.etags[version]

    def fetched(self) -> list[str]:
        """The names of whole-file GETs of shards (not of a footer, nor of the listing), in
        order."""
        with self.lock:
            return [name for name, wanted in self.gets if wanted is None and name != LISTING]

    def close(self) -> None:
        """Stop serving: from now on connections are refused, as when a server goes away."""
        self.shutdown()
        self.server_close()


# -----------------------------------------------------------------------------
# Command line: python -m nanochat.dataset serve DIR

SERVE_HELP = ("Serve a directory of parquet shards over HTTP, with Range requests, so that a "
              "streaming loader (stream=True) can read them: its *.parquet files (symlinks "
              "followed), and index.json, their listing (the directory's own index.json when it "
              "has one). Nothing else: any other name, or another file in DIR, is a 404. Val is "
              "the last name in sorted order, train the others, as on disk. Runs until Ctrl-C.")


def main(argv: list[str]) -> int:
    """`python -m nanochat.dataset serve DIR [--port 8000] [--host H] [--rate B]`: serve until
    Ctrl-C, which it raises (KeyboardInterrupt). Raises FileNotFoundError/ValueError for a
    directory it cannot serve."""
    parser = argparse.ArgumentParser(prog="python -m nanochat.dataset serve",
                                     description=SERVE_HELP)
    parser.add_argument("directory", metavar="DIR", help="the directory of *.parquet shards")
    parser.add_argument("--port", type=int, default=8000,
                        help="TCP port (default: 8000; 0: a free one, printed)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1, this machine only; "
                             "0.0.0.0: every interface, no authentication)")
    parser.add_argument("--rate", type=float, default=None, metavar="BYTES_PER_S",
                        help="serve at most this many bytes/s of files, all connections "
                             "together (default: no limit)")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    if args.rate is not None and not args.rate > 0:
        parser.error(f"--rate must be > 0 bytes/s, got {args.rate:g}")
    directory = os.path.expanduser(args.directory)
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise FileNotFoundError(f"{directory} {what}; pass the directory that holds your "
                                "*.parquet shards")
    own = os.path.isfile(os.path.join(directory, LISTING))
    names = [entry["name"] for entry in directory_listing(directory)["files"]]
    if not names and not own:
        raise FileNotFoundError(f"{directory} holds no *.parquet files; write some first: "
                                "python -m nanochat.dataset repackage my.jsonl --out DIR")
    try:
        server = ShardServer(directory, args.rate, host=args.host, port=args.port)
    except OSError as e:  # (the port taken, a host not of this machine)
        raise OSError(e.errno, f"cannot listen on {args.host} port {args.port} ({e.strerror}); "
                               "pass another --port, or --port 0 for a free one") from None
    split = (f"its own {LISTING}" if own
             else f"{len(names)} parquet files, val {names[-1]}" if len(names) > 1
             else f"1 parquet file, {names[0]}: a loader needs 2, train and val")
    # one line: where, what, and the settings that stream from it (flush: a pipe sees it now)
    print(f"serving {directory} ({split}) at {server.url}; stream it with stream=True, "
          f"base_url=\"{server.url}\", data_dir=CACHE (a directory of its own), or "
          f"NANOCHAT_STREAM=1 NANOCHAT_DATA_URL={server.url} NANOCHAT_DATA_DIR=CACHE for scripts "
          "that pass no data_dir (nanochat's); Ctrl-C stops", flush=True)
    try:
        threading.Event().wait()  # the server runs on its thread; only Ctrl-C ends this wait
    finally:
        server.close()  # (and nanochat.data.base.cli.run says, in one line, that it stopped)

"""
A local shard server for the demo, the streaming benchmark and the tests: serves a directory's
files on 127.0.0.1 the way the Hugging Face hub serves a dataset's, with Range requests (what a
streaming loader reads footers with, and what resumes a broken download), an ETag that is the
body's quoted sha256, and optionally a rate limit shared by all connections (a link of so many
bytes/s). It logs the requests it answered, in order.

    server = ShardServer(directory, rate=50e6)   # started on a free port, on a daemon thread
    server.url                                   # http://127.0.0.1:PORT
    server.gets                                  # [(name, Range header or None), ...]
    server.close()                               # gone: later connections are refused
"""

import hashlib
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BLOCK = 64 * 1024  # bytes written at a time (and the rate limiter's step)


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

    def _file(self) -> str | None:
        name = self.path.rsplit("/", 1)[-1]
        path = os.path.join(self.server.directory, name)
        # a plain file name only: nothing outside the directory is ever served
        return path if re.fullmatch(r"[\w.-]+", name) and os.path.isfile(path) else None

    def _headers(self, code: int, length: int, path: str,
                 content_range: str | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{self.server.etag(path)}"')
        if content_range:
            self.send_header("Content-Range", content_range)
        self.end_headers()

    def do_HEAD(self):
        path = self._file()
        if path is None:
            self.send_error(404)
            return
        self._headers(200, os.path.getsize(path), path)

    def do_GET(self):
        path, wanted = self._file(), self.headers.get("Range")
        with self.server.lock:
            self.server.gets.append((self.path.rsplit("/", 1)[-1], wanted))
        if path is None:
            self.send_error(404)
            return
        size = os.path.getsize(path)
        first, last = 0, size - 1
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", (wanted or "").strip())
        if_range = self.headers.get("If-Range")
        # If-Range naming another version: the whole file, as the hub answers
        if match and (if_range is None or if_range == f'"{self.server.etag(path)}"'):
            if match.group(1):  # bytes=first- or bytes=first-last
                first, last = int(match.group(1)), min(int(match.group(2) or size - 1), size - 1)
            elif match.group(2):  # bytes=-n: the last n bytes
                first = max(size - int(match.group(2)), 0)
            if first > last:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self._headers(206, last - first + 1, path, f"bytes {first}-{last}/{size}")
        else:
            self._headers(200, size, path)
        with open(path, "rb") as f:
            f.seek(first)
            left = last - first + 1
            while left > 0:
                block = f.read(min(BLOCK, left))
                self.server.throttle.take(len(block))
                try:
                    self.wfile.write(block)
                except (BrokenPipeError, ConnectionResetError):  # the client hung up
                    return
                left -= len(block)


class ShardServer(ThreadingHTTPServer):
    daemon_threads = True  # a connection still open never keeps a test process alive

    def __init__(self, directory: str, rate: float | None = None):
        super().__init__(("127.0.0.1", 0), _Handler)  # port 0: a free port, chosen by the kernel
        self.directory, self.throttle = directory, Throttle(rate)
        self.gets: list[tuple[str, str | None]] = []
        self.etags: dict[str, str] = {}
        self.lock = threading.Lock()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, name="shard-server", daemon=True).start()

    def etag(self, path: str) -> str:
        with self.lock:
            if path not in self.etags:  # hashed once: a file is served many times
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    while block := f.read(1 << 20):
                        h.update(block)
                self.etags[path] = h.hexdigest()
            return self.etags[path]

    def fetched(self) -> list[str]:
        """The names of whole-file GETs (not Range requests for a footer), in order."""
        with self.lock:
            return [name for name, wanted in self.gets if wanted is None]

    def close(self) -> None:
        """Stop serving: from now on connections are refused, as when a server goes away."""
        self.shutdown()
        self.server_close()

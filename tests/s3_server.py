"""A real S3 API on 127.0.0.1 for tests: moto's standalone server in a subprocess (S3Server), a
fault-injecting reverse proxy in front of it (FaultProxy), and a bucket helper (S3Bucket) that
uploads straight to the server. conftest.py wraps them as the `s3_server`, `s3` and `s3_faulty`
fixtures. Only the standard library is imported here at the top; boto3 is imported by S3Bucket,
so that this file imports without the dev extras. Run its own tests:
python -m pytest tests/test_s3_server.py -q
"""

import atexit
import http.client
import http.server
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import NamedTuple

START_TIMEOUT_S = 20.0  # moto answers in ~0.5 s; 20 s means it is broken, not slow


def free_port() -> int:
    """A port the OS says is free now (another process may take it before we bind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        conn.request("GET", "/")
        conn.getresponse().read()
        conn.close()
        return True
    except OSError:
        return False


def _die_with_parent() -> None:
    """In the child: on Linux, ask for SIGTERM when the parent dies, so that even a killed pytest
    leaves no server behind (the signal follows the thread that started it: the main one here)."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


# -----------------------------------------------------------------------------
# The server: moto_server in a subprocess

class S3Server:
    """moto's S3 server on a free 127.0.0.1 port. Use as a context manager or call stop()."""

    def __init__(self):
        exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
        if not os.path.exists(exe):
            raise FileNotFoundError(f"{exe} is missing; install the dev extras: "
                                    "pip install -e \".[dev]\"")
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile()  # moto's output, shown if it fails to start
        self._proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)],
                                      stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        atexit.register(self.stop)  # a backstop if no fixture finalizer runs
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                self._log.seek(0)
                tail = self._log.read()[-2000:].decode(errors="replace")
                raise RuntimeError(f"moto_server did not answer on {self.endpoint} within "
                                   f"{START_TIMEOUT_S:.0f} s (exit code {self._proc.returncode}); "
                                   f"its output:\n{tail}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Terminate the server and wait for it; kill it if it does not exit in 5 s."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()
        atexit.unregister(self.stop)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# -----------------------------------------------------------------------------
# The proxy: forwards to the server, and fails on request

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
              "trailer", "upgrade", "expect"}  # expect: the proxy itself answers 100-continue
SLOW_DOWN_XML = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                 b'<Message>Please reduce your request rate.</Message>'
                 b'<RequestId>FAULTPROXY</RequestId></Error>')
CHUNK = 64 * 1024


class Seen(NamedTuple):
    """One request the proxy received: its method, path (with the query) and Range header."""
    method: str
    path: str
    range: str | None


class _Fault:
    """A fault for the next `times` matching requests (path: a substring the path must contain)."""

    def __init__(self, times: int, path: str | None, nbytes: int = 0):
        self.times, self.path, self.nbytes = times, path, nbytes

    def take(self, path: str) -> bool:
        if self.times > 0 and (self.path is None or self.path in path):
            self.times -= 1
            return True
        return False


class FaultProxy:
    """A threaded HTTP reverse proxy on 127.0.0.1 in front of `upstream` (an http://host:port).
    Faults are set at any time from the test: slow_down, cut_after, stop/start. Request bodies
    must carry a Content-Length (chunked uploads get 501: upload straight to the server)."""

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._seen: list[Seen] = []
        self._slow = _Fault(0, None)
        self._cut = _Fault(0, None)
        self._conns: set[socket.socket] = set()  # open client connections, cut by stop()
        self._server = None
        atexit.register(self.stop)
        self.start()

    # --- faults and counters, all under the lock
    def slow_down(self, n: int, *, path: str | None = None) -> None:
        """The next n requests (whose path contains `path`, if given) get 503 SlowDown."""
        with self._lock:
            self._slow = _Fault(n, path)

    def cut_after(self, nbytes: int, times: int = 1, *, path: str | None = None) -> None:
        """The next `times` 2xx GET responses whose body is longer than nbytes (and whose path
        contains `path`, if given) send nbytes of body, then the connection is closed."""
        with self._lock:
            self._cut = _Fault(times, path, nbytes)

    def count(self, method: str | None = None) -> int:
        """Requests received (faulted ones included), of one method or of all."""
        with self._lock:
            return sum(1 for s in self._seen if method is None or s.method == method)

    def seen(self) -> list[Seen]:
        """Every request received so far, in order."""
        with self._lock:
            return list(self._seen)

    def clear(self) -> None:
        """Forget the requests seen and any pending fault."""
        with self._lock:
            self._seen.clear()
            self._slow, self._cut = _Fault(0, None), _Fault(0, None)

    # --- listening
    def start(self) -> None:
        """Listen (again) on the same port."""
        if self._server is not None:
            return
        self._server = _Server(("127.0.0.1", self.port), _Handler)
        self._server.proxy = self
        # poll every 50 ms: stop() waits for the loop to notice
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self) -> None:
        """Stop listening (new connections are refused) and cut every open connection."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server = None
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its client

    def close(self) -> None:
        self.stop()
        atexit.unregister(self.stop)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    proxy: FaultProxy

    def handle_error(self, request, client_address):
        pass  # a cut or refused connection is the point here, not an error to print


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect

    def setup(self):
        super().setup()
        with self.server.proxy._lock:
            self.server.proxy._conns.add(self.connection)

    def finish(self):
        with self.server.proxy._lock:
            self.server.proxy._conns.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass  # the connection was cut

    def log_message(self, format, *args):
        pass

    def _forward(self):
        proxy = self.server.proxy
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._reply(501, b"FaultProxy: chunked request bodies are not supported")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with proxy._lock:
            proxy._seen.append(Seen(self.command, self.path, self.headers.get("Range")))
            slow = proxy._slow.take(self.path)
        if slow:
            return self._reply(503, SLOW_DOWN_XML, "application/xml")

        upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
        try:
            # the client's Host header is kept: it is part of what the client signed
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            resp = upstream.getresponse()
            self._relay(resp)
        finally:
            upstream.close()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

    def _relay(self, resp: http.client.HTTPResponse) -> None:
        """Send the upstream response back, streaming its body; cut it if a fault says so."""
        proxy = self.server.proxy
        length = resp.getheader("Content-Length")
        no_body = self.command == "HEAD" or resp.status in (204, 304)
        data = None
        if length is None and not no_body:  # an upstream chunked body: buffer it to size it
            data = resp.read()
            length = str(len(data))
        cut = None
        if self.command == "GET" and 200 <= resp.status < 300:
            with proxy._lock:
                if int(length or 0) > proxy._cut.nbytes and proxy._cut.take(self.path):
                    cut = proxy._cut.nbytes

        self.send_response_only(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in HOP_BY_HOP and k.lower() != "content-length":
                self.send_header(k, v)
        if length is not None:
            self.send_header("Content-Length", length)
        self.end_headers()
        if no_body:
            return
        left = int(length) if cut is None else cut
        while left > 0:
            chunk = data[:left] if data is not None else resp.read(min(CHUNK, left))
            if not chunk:
                break
            data = data[len(chunk):] if data is not None else None
            self.wfile.write(chunk)
            left -= len(chunk)
        if cut is not None:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)  # the client sees a short body
            self.close_connection = True

    def _reply(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response_only(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


# -----------------------------------------------------------------------------
# A bucket for one test, written straight to the server

class S3Bucket:
    """A fresh bucket on `endpoint` with a unique name. Writes go straight to `endpoint` (never
    through a proxy), so faults only hit the code under test. After a write mid-test, an s3fs
    instance the code holds may need fs.invalidate_cache() to see it."""

    def __init__(self, endpoint: str, proxy: FaultProxy | None = None):
        import boto3  # a dev extra

        self.endpoint, self.proxy = endpoint, proxy
        self.bucket = f"test-{uuid.uuid4().hex[:16]}"
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                   aws_access_key_id="testing", aws_secret_access_key="testing")
        self.client.create_bucket(Bucket=self.bucket)

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def upload(self, local_path, key: str) -> None:
        self.client.upload_file(str(local_path), self.bucket, key)

    def upload_dir(self, local_dir, prefix: str = "") -> list[str]:
        """Upload every file under local_dir as prefix/relative/path; returns the keys, sorted."""
        keys = []
        for root, _, names in os.walk(local_dir):
            for name in names:
                path = os.path.join(root, name)
                rel = os.path.relpath(path, local_dir).replace(os.sep, "/")
                keys.append(f"{prefix.rstrip('/')}/{rel}" if prefix else rel)
                self.upload(path, keys[-1])
        return sorted(keys)

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)

    def keys(self, prefix: str = "") -> list[str]:
        """The keys under prefix, sorted."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                       Prefix=prefix)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))

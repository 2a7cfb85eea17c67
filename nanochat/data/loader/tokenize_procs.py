"""
Tokenizing on processes: one copy of the encoder per process, batches back in the order they went.
tiktoken lets go of the GIL only inside a text: the Python work around each one (the call, a list
of ids, its conversion to numpy) holds the GIL of the process it runs in, so threads stop scaling
past a core or two. Here each process encodes whole document batches on one thread, batch i on
process i mod N, and the loader takes them back in order: the batches are byte-identical at any N.
Each is a fresh interpreter (`python -m` this module, as the worker is: a fork would copy the
trainer's threads and locks), at the lowest priority; one that dies ends the loader with an error,
never a hang.

Cost: per process, an interpreter with the tokenizer (~100 MB); per batch, its texts pickled out
and its documents pickled back.

May import: nanochat.data.loader.rows, nanochat.data.loader.worker.
"""

import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
from collections import deque
from multiprocessing import Pipe
from multiprocessing.connection import Connection

from nanochat.data.loader.rows import TokenBatch
from nanochat.data.loader.worker import import_path

# batches out per process: one encoding, one waiting, so that a process never idles on the loader
IN_FLIGHT = 2
NICENESS = 19  # the trainer's threads come first where they share a core


def encoded_on_processes(doc_batches, encoder, processes: int):
    """Yield a TokenBatch for each DocBatch, as rows.token_batches does, the encoding done by
    `processes` processes; at most IN_FLIGHT * processes batches are out at once."""
    payload = pickle.dumps(encoder)
    tokenizers: list[Tokenizer] = []
    pending: deque = deque()  # the batches out, oldest first: batch i is on process i mod N
    try:
        tokenizers += [Tokenizer() for _ in range(processes)]  # they start up side by side
        for tokenizer in tokenizers:
            tokenizer.conn.send_bytes(payload)
        for sent, batch in enumerate(doc_batches):
            tokenizers[sent % processes].send(batch.items)
            pending.append((tokenizers[sent % processes], batch))
            if len(pending) == IN_FLIGHT * processes:
                yield _taken(*pending.popleft())
        while pending:
            yield _taken(*pending.popleft())
    finally:  # (a closed loader: the batches still out are dropped with their processes)
        for tokenizer in tokenizers:
            tokenizer.close()


def _taken(tokenizer: "Tokenizer", batch) -> TokenBatch:
    docs, overlaps = tokenizer.receive()
    return TokenBatch(docs, overlaps, batch.keys, batch.after, batch.starts)


class Tokenizer:
    """One tokenizing process and the pipe to it: texts go out, (documents, overlaps) come back,
    in the order they went."""

    def __init__(self):
        ours, theirs = Pipe()
        env = os.environ | {"PYTHONPATH": os.pathsep.join(import_path())}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __spec__.name, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()  # the process holds it now: when it ends, our reads end too
        self.conn = ours  # the encoder goes first, pickled, then the batches

    def send(self, texts: list[str]) -> None:
        try:
            self.conn.send_bytes(pickle.dumps(texts, pickle.HIGHEST_PROTOCOL))
        except OSError:  # (its end closed: it died)
            raise self._died() from None

    def receive(self):
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError):
            raise self._died() from None
        if kind == "error":
            raise value  # the encoder's own error, as it was raised there (bad data, a bad id)
        return value

    def _died(self) -> RuntimeError:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return RuntimeError(f"a tokenizing process of the loader died (exit status {code}: killed, "
                            "or out of memory?); pass tokenizer_processes=0 to tokenize on "
                            "threads, or give the job more memory")

    def close(self) -> None:
        self.conn.close()  # its next read ends: it stops after the batch in its hands
        self.process.terminate()  # or now
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# -----------------------------------------------------------------------------
# In each process: a thread takes the batches in as they come (so that the loader's sends never
# wait on this process's reply), the main thread encodes them one by one and replies


def _serve(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the trainer decides, and closes us
    os.nice(max(0, NICENESS - os.nice(0)))
    conn = Connection(fd)
    encoder = pickle.loads(conn.recv_bytes())
    encoder.threads = 1  # the processes are the parallelism
    batches: queue.SimpleQueue = queue.SimpleQueue()

    def take_in() -> None:
        try:
            while True:
                batches.put(conn.recv_bytes())
        except (EOFError, OSError):  # the loader closed its end, or ended
            batches.put(None)

    threading.Thread(target=take_in, daemon=True).start()
    while (batch := batches.get()) is not None:
        try:
            reply = ("ok", encoder(pickle.loads(batch)))
        except Exception as e:
            reply = ("error", e)
        try:
            conn.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # an error that won't pickle
            conn.send(("error", RuntimeError(f"{type(reply[1]).__name__}: {reply[1]} ({e})")))
        except OSError:
            return


if __name__ == "__main__":
    _serve(int(sys.argv[1]))

"""
Bytes from a source to a file on disk that is complete and verified.
Over HTTP or from an object store through fsspec, each file with its sidecar record; what a source
lists; `serve`, a local server of shards; and `repackage`, your own text written as shards.

May import: nanochat.data.base.
"""

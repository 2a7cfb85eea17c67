"""
Bytes from a source to a file on disk that is complete and verified: HTTP, object stores through
fsspec, the sidecar records, and `serve`, a local server of shards. Also what a source lists, its
address as messages show it, and `repackage`, your own text written as shards.

May import: nanochat.data.base.
"""

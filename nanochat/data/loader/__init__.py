"""
One rank's walk from shards to packed rows.
The order of row groups (or token units), documents to rows, the threads or worker process that
run ahead, the resume checks and the elastic merge, and the figures a loader reports.

May import: nanochat.data.base, nanochat.data.fetch, nanochat.data.pretokenized,
nanochat.data.streaming.
"""

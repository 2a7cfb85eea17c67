"""
One rank's walk from shards to packed rows.
Its split's parquet files, the order of row groups (or token units), documents to rows, the threads
or worker process that run ahead, the resume checks and elastic merge, and a loader's figures.

May import: nanochat.data.base, nanochat.data.fetch, nanochat.data.pretokenized,
nanochat.data.streaming.
"""

"""
Bytes from a source to a file on disk that is complete and verified: download.py drives one file or
many, over http_transport.py or store_transport.py (stores.py, through fsspec); install.py,
verify.py, records.py and sources.py keep every name sound; serve.py serves shards locally.

May import: nanochat.data.base.
"""

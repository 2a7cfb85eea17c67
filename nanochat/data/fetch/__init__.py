"""
Bytes from a source to a file on disk that is complete and verified.
download.py drives one file or many, over http_transport.py or store_transport.py (stores.py,
through fsspec; both load only where a store's address is met); address.py names an address's
forms; install, verify, records and sources keep every name sound; listing reads what a source
lists; serve.py serves shards locally; repackage writes your own text as shards.

May import: nanochat.data.base.
"""

"""
The streaming cache (stream=True): shards fetched just ahead of the reader, within cache_limit.
The streamed split names the shards, the catalog gives sizes, the ledger says which live loader
needs which shard, kept copies hold buffered documents, and cache_status prints it all.

May import: nanochat.data.base, nanochat.data.fetch.
"""

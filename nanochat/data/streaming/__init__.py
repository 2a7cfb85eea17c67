"""
The streaming cache (stream=True): shards fetched just ahead of the reader, within cache_limit.
The cache is the reader's side; the budget decides, purely, what must be held and what may go;
eviction and the fetching thread act on it; visits track the reader's order. The streamed split
names the shards, the catalog gives sizes, the ledger says which live loader needs which shard,
kept copies hold buffered documents, and cache_status prints it all.

May import: nanochat.data.base, nanochat.data.fetch.
"""

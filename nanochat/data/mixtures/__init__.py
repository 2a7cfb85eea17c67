"""
Mixtures: buckets of pretokenized shards, each walked by its own loader, drawn by weights.
The weights may change over the tokens (a curriculum); one resumable state holds every bucket's.

May import: nanochat.data.base, nanochat.data.pretokenized, nanochat.data.loader.
"""

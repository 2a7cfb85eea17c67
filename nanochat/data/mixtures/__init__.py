"""
Mixtures: buckets of pretokenized shards, each walked by its own loader, drawn by weights that may
change over the tokens (a curriculum), with one resumable state for all of them.

May import: nanochat.data.base, nanochat.data.pretokenized, nanochat.data.loader.
"""

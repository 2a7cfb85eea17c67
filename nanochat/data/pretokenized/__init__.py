"""
Token shards in GPT-Simple's .bin/.idx format: one shard's bytes, a directory's layout, and the
reader that walks their documents for the loader.

May import: nanochat.data.base, nanochat.data.fetch.
"""

"""
Token shards in GPT-Simple's .bin/.idx format: their bytes and their reader.
token_shards.py holds one shard's bytes, and token_reader.py walks the shards' documents for the
loader. base/layout.py tells a directory's kind from its names; processing/ writes the shards.

May import: nanochat.data.base, nanochat.data.fetch.
"""

"""
Token shards in GPT-Simple's .bin/.idx format: their bytes, their layout, their reader.
token_shards.py holds one shard's bytes, layout.py tells a directory's kind from its names, and
token_reader.py walks the shards' documents for the loader. processing/ writes them.

May import: nanochat.data.base, nanochat.data.fetch.
"""

"""
Token shards in GPT-Simple's .bin/.idx format: writing them (pretokenize's run: its inputs,
windows, one pair per input on worker processes, the settings and locks), one shard's bytes, a
directory's layout, and the reader that walks their documents for the loader.

May import: nanochat.data.base, nanochat.data.fetch.
"""

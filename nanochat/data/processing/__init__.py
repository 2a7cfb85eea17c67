"""
Writing token shards: `python -m nanochat.pretokenize`'s run, from its inputs to the pairs on disk.
Its inputs and the pair each becomes, the windows of long documents, one input to its pair, the
worker processes, the settings a run records and the lock on its output.

May import: nanochat.data.base, nanochat.data.fetch, nanochat.data.pretokenized.
"""

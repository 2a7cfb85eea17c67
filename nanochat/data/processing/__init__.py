"""
Writing token shards: `python -m nanochat.pretokenize`'s run, from its inputs to the pairs on disk.
A job's units of work (whole inputs, and parts of large ones) and the pair each becomes, the two
calls any engine drives (units.py), the windows of long documents, one unit to its pair, the
executors (this machine's worker processes, a Ray cluster), Slurm's ranks, the settings a run
records and the lock on its output.

May import: nanochat.data.base, nanochat.data.fetch, nanochat.data.pretokenized.
"""

"""
The ground floor: the pure pieces every stage uses.
Best-fit packing, the resume state's format and its checks, the seeded shuffle, integer checks,
atomic files, the command-line ending, the datasets we know and their splits, and reading a
parquet shard's text.

May import: the standard library, numpy, tqdm, pyarrow; of ours, base/ itself and nanochat.common.
"""

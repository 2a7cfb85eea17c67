"""
Our data pipeline, one folder per stage, under nanochat's three files and the command fronts.
dataloader.py, dataset.py and tokenizer.py, and the fronts beside them (pretokenize, mixture,
resume, shard_cache), import these folders; a nanochat checkout gets the three files and this folder
(README: In a nanochat checkout). The folders, lowest floor first:

    base/          what every stage stands on: packing, the state's format, checks, the shuffle
    tokenizing/    the tokenizer's files: their names, nanochat's pickle read safely, the HF export
    fetch/         bytes from a source to a verified file on disk: HTTP, object stores, serve
    pretokenized/  token shards (.bin/.idx): their format and reader
    processing/    writing token shards: pretokenize's run, from its inputs to the pairs on disk
    streaming/     the cache that fetches shards just ahead of the reader, within cache_limit
    loader/        one rank's walk from shards to packed rows, its worker, resume and figures
    mixtures/      buckets over loaders, with weights over the tokens

May import: a folder imports its own modules, the folders its __init__.py names (lower floors in
this list) and nanochat.common; never nanochat's three files or the fronts (they import us).
tests/test_architecture.py holds these rules.
"""

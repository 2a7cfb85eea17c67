"""
Our data pipeline, behind nanochat's three files (dataloader.py, dataset.py, tokenizer.py) and the
command fronts beside them. One folder per stage, lowest floor first:

    base/          what every stage stands on: packing, the state's format, checks, the shuffle
    tokenizing/    the tokenizer's files: their names, nanochat's pickle read safely, the HF export
    fetch/         bytes from a source to a verified file on disk: HTTP, object stores, serve
    pretokenized/  token shards (.bin/.idx): their format, layout and reader
    streaming/     the cache that fetches shards just ahead of the reader, within cache_limit
    loader/        one rank's walk from shards to packed rows, its worker, resume and figures
    mixtures/      buckets over loaders, with weights over the tokens

May import: a folder imports only the folders above it in this list, nanochat.common, and never
nanochat's files or the fronts (they import us). tests/test_architecture.py holds it.
"""

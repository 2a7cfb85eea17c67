"""nanochat's data pipeline: parquet shards -> BPE tokens -> BOS-aligned packed batches."""

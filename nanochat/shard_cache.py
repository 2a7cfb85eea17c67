"""
The command that shows what a streaming cache (stream=True) holds, and why.
`python -m nanochat.shard_cache status [DATA_DIR]` lists the shards against cache_limit, and which
live loader needs which shard and why. The cache itself is nanochat/data/streaming/cache.py.

May import: nanochat.data.base, nanochat.data.streaming.
"""

from nanochat.data.base.cli import run
from nanochat.data.streaming.cache import main

if __name__ == "__main__":
    run(main, "status stopped; it only reads: rerun it")

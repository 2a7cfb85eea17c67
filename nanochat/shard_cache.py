"""
The command that shows what a streaming cache (stream=True) holds, and why.
`python -m nanochat.shard_cache status [DATA_DIR]` lists the shards against cache_limit, and which
live loader needs which shard and why. The cache itself is nanochat/data/streaming/cache.py.

May import: nanochat.data.base, nanochat.data.streaming, nanochat.dataset.
"""

import argparse
import os
import sys

from nanochat.data.base.cli import run
from nanochat.data.streaming.cache_status import describe, read_status
from nanochat.data.base.datasets import find_data_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanochat.shard_cache",
                                     description="What a streaming cache (stream=True) holds.")
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="what is on disk against cache_limit, which live "
                                 "loader needs which shard and why, the kept copies, the evicted",
                                 description="Print what a streaming cache holds: its bytes on "
                                 "disk against cache_limit, which live loader needs which shard "
                                 "and why, the kept copies of buffered documents, and the shards "
                                 "evicted.")
    status.add_argument("data_dir", nargs="?", help="the streaming cache: a loader's data_dir "
                        "(default: the dataset's directory, as the loaders find it)")
    args = parser.parse_args(argv)
    data_dir = find_data_dir() if args.data_dir is None else os.path.expanduser(args.data_dir)
    if not os.path.isdir(data_dir):
        print(f"{data_dir} is not a directory", file=sys.stderr)
        return 1
    print(describe(read_status(data_dir)))
    return 0


if __name__ == "__main__":
    run(main, "status stopped; it only reads: rerun it")

"""
One rank of the streaming process tests (run by test_streaming_processes.py, plain or under
torchrun): a training script in miniature. Its loader streams because the environment says so
(NANOCHAT_STREAM=1, the cache is NANOCHAT_BASE_DIR's dataset directory, NANOCHAT_DATA_URL,
NANOCHAT_STREAM_SHARDS, NANOCHAT_CACHE_LIMIT); each batch's rows and state go to
OUT_DIR/rank<RANK>.jsonl as one line the moment it has them (the test may kill it). Under torchrun
the ranks take each batch together (a gloo barrier), as DDP training steps do.
STREAM_WORKER_IDLE=1: after the last batch it idles, its loader open, until the test kills it.
STREAM_WORKER_LOADER: JSON of loader arguments in place of LOADER's.
Usage: [torchrun ...] stream_worker.py OUT_DIR NUM_BATCHES [RESUME_JSON]
"""
import json
import os
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import ByteTokenizer  # noqa: E402
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit

# prefetch=0: a rank reads only what its next batch needs, so ranks that step together read the
# same shards at the same time (the tests count downloads per shard visit)
LOADER = dict(
    B=2, T=32, split="train", device="cpu", buffer_size=8, tokenizer_batch_size=2, prefetch=0
)


def rows_of(inputs, targets) -> list[list[int]]:
    """A batch as its rows of T + 1 tokens: the inputs plus the last target."""
    return [x + [y[-1]] for x, y in zip(inputs.tolist(), targets.tolist())]


def main():
    out_dir, num_batches = sys.argv[1], int(sys.argv[2])
    resume = None
    if len(sys.argv) > 3:
        with open(sys.argv[3]) as f:
            resume = json.load(f)
    together = "WORLD_SIZE" in os.environ
    if together:
        dist.init_process_group("gloo")
    # STREAM_WORKER_LOADER: JSON of loader arguments that replace LOADER's
    settings = LOADER | json.loads(os.environ.get("STREAM_WORKER_LOADER", "{}"))
    loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), resume_state_dict=resume, **settings
    )
    with open(os.path.join(out_dir, f"rank{os.environ.get('RANK', '0')}.jsonl"), "w") as f:
        for _ in range(num_batches):
            if together:
                dist.barrier()
            inputs, targets, state = next(loader)
            f.write(json.dumps({"rows": rows_of(inputs, targets), "state": state}) + "\n")
            f.flush()
    # (its loader stays open until the test kills it)
    if os.environ.get("STREAM_WORKER_IDLE"):
        time.sleep(3600)
    loader.close()
    if together:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""
One rank of the multi-process sharding test (run by test_distributed.py under torchrun, gloo, CPU).
Reads RANK/WORLD_SIZE like a training script would, runs both loaders on its shard of the data,
and sends what it emitted to rank 0, which writes it as JSON (test_worker.py calls `emitted`
itself for the ranks on threads).
Usage: torchrun --nproc_per_node=N tests/dist_worker.py DATA_DIR OUT_JSON NUM_BATCHES
"""

import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import ByteTokenizer  # noqa: E402
from nanochat.common import get_dist_info  # noqa: E402
from nanochat.dataloader import (tokenizing_distributed_data_loader_with_state,
                                 tokenizing_distributed_data_loader_with_state_bos_bestfit)


def main():
    data_dir, out_path, num_batches = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    ddp, rank, _, world_size = get_dist_info()
    assert ddp and rank == dist.get_rank() and world_size == dist.get_world_size()
    mine = emitted(data_dir, num_batches)  # the loaders take the rank from the environment
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def emitted(data_dir: str, num_batches: int, **where) -> dict:
    """What both loaders emit on this rank; `where` gives rank and world_size to a call outside
    torchrun (under it, none: the loaders read them from the environment)."""
    tok = ByteTokenizer()
    B, T = 2, 32
    # the concatenating loader: the stream is every batch's inputs, then the last batch's last
    # target (each batch's last target is the next batch's first input)
    concat_stream = []
    loader = tokenizing_distributed_data_loader_with_state(tok, B, T, "train", device="cpu",
                                                           data_dir=data_dir,
                                                           tokenizer_batch_size=3, **where)
    for _ in range(num_batches):
        inputs, targets, state = next(loader)
        concat_stream += inputs.flatten().tolist()
    concat_stream.append(targets[-1, -1].item())
    workers = [loader.worker_pid is not None]  # (NANOCHAT_LOADER_WORKERS decides)
    loader.close()
    # the best-fit loader: rows (every document starts with BOS), and the states
    rows, states = [], []
    loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tok, B, T, "train", device="cpu", data_dir=data_dir, buffer_size=8, tokenizer_batch_size=3,
        **where)
    for _ in range(num_batches):
        inputs, targets, state = next(loader)
        full = torch_cat_rows(inputs, targets)
        rows += full
        states.append(state)
    workers.append(loader.worker_pid is not None)
    loader.close()
    rank = where.get("rank", get_dist_info()[1])
    return {"rank": rank, "concat_stream": concat_stream, "bestfit_rows": rows, "states": states,
            "workers": workers}


def torch_cat_rows(inputs, targets):
    # a row of T+1 tokens is the inputs plus the last target
    return [x + [y[-1]] for x, y in zip(inputs.tolist(), targets.tolist())]


if __name__ == "__main__":
    main()

"""
One rank of the elastic-resume test (run by test_elastic.py under torchrun, gloo, CPU; the test
calls run_rank itself for the old ranks, one after the other).
  old: run NUM_BATCHES batches from the start, then save this rank's state (as a training script
       does at a checkpoint) and the documents placed in every row (trace_documents=True).
  new: resume from the merged state in RESUME_JSON and run until this rank has read its whole share
       of the old epochs (its plan is empty), then 5 batches more; its final state says which of
       those documents still wait in its buffer.
Rank 0 writes what every rank saw to OUT_JSON.
With NANOCHAT_TEST_SHUFFLE=1 in the environment, the loader shuffles (seed 5, windows of 2 row
groups).
Usage: torchrun --nproc_per_node=N tests/elastic_worker.py MODE DATA_DIR OUT_JSON NUM_BATCHES
       [RESUME_JSON]
"""

import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import ByteTokenizer  # noqa: E402
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit

B, T, BUFFER, TBS = 2, 24, 8, 3


def main():
    mode, data_dir, out_path, num_batches = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    resume = None
    if mode == "new":
        with open(sys.argv[5]) as f:
            resume = json.load(f)
    dist.init_process_group("gloo")
    mine = run_rank(mode, data_dir, num_batches, resume,  # (the rank from the environment)
                    shuffle=os.environ.get("NANOCHAT_TEST_SHUFFLE") == "1")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def run_rank(mode: str, data_dir: str, num_batches: int, resume=None, shuffle=False,
             **where) -> dict:
    """What one rank saw; `where` gives rank and world_size to a call outside torchrun."""
    loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        ByteTokenizer(), B, T, "train", device="cpu", data_dir=data_dir, buffer_size=BUFFER,
        tokenizer_batch_size=TBS, resume_state_dict=resume, trace_documents=True,
        shuffle=shuffle, seed=5, shuffle_window=2, **where)
    rows, placed, state, extra = [], [], None, 5
    for step in range(num_batches):
        inputs, targets, state = next(loader)
        rows += [x + [y[-1]] for x, y in zip(inputs.tolist(), targets.tolist())]
        placed += [[list(key) for key in row] for row in loader.documents]
        if mode == "new" and not state["plan"]:
            extra -= 1
            if extra == 0:
                break
    loader.close()
    rank = where["rank"] if "rank" in where else dist.get_rank()
    return {"rank": rank, "rows": rows, "placed": placed, "state": state, "batches": step + 1}


if __name__ == "__main__":
    main()

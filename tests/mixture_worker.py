"""
One rank of test_mixture.py::test_ranks_stop_at_the_same_step, under torchrun with gloo:
    torchrun --nproc_per_node 2 tests/mixture_worker.py DATA_DIR OUT_DIR [dry|fail]
Runs the mixture loader until it stops and writes OUT_DIR/rank{r}.json: the step at which it raised
BucketExhausted, the bucket it names (None: it ran dry on another rank), and whether the exception's
state is the state of the last batch this rank yielded. "fail": rank 1's shard reads fail after a
while; the step and error each rank raised.
"""

import json
import os
import sys

import torch.distributed as dist

from nanochat.mixture import BucketExhausted, pretokenized_mixture_loader_with_state_bos_bestfit


def main():
    data_dir, out_dir = sys.argv[1], sys.argv[2]
    mode = sys.argv[3] if len(sys.argv) > 3 else "dry"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "fail" and rank == 1:  # a fault on one rank only: its shard reads fail after a while
        import nanochat.data.pretokenized.token_reader as token_reader
        pick, calls = token_reader.TokenShardReader.pick, [0]

        def failing_pick(unit, doc_indices):
            calls[0] += 1
            if calls[0] > 12:
                raise OSError("injected read error")
            return pick(unit, doc_indices)
        token_reader.TokenShardReader.pick = staticmethod(failing_pick)
    curriculum = [{"tokens": 60_000, "mix": {"web": 0.9, "tiny": 0.1}}]
    loader = pretokenized_mixture_loader_with_state_bos_bestfit(
        4, 99, "train", curriculum, device="cpu", data_dir=data_dir, buffer_size=4, chunk_size=4,
        batch_size=4, allow_bucket_exhaustion=False,
        bos_token=1)  # test_mixture.py's BOS (its shards have no pretokenize.json)
    step, last = 0, None
    report = {"rank": rank, "step": None, "bucket": None, "state_is_last": False, "error": None}
    try:
        while step < 1000:
            _, _, last = next(loader)
            step += 1
            dist.barrier()  # a training step's collective: a rank left behind would hang here
    except BucketExhausted as e:
        report.update(step=step + 1, bucket=e.bucket, state_is_last=e.state == last)
    except (OSError, RuntimeError) as e:
        report.update(step=step + 1, error=f"{type(e).__name__}: {e}")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    loader.close()
    dist.barrier()  # both ranks are done with the group before either tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

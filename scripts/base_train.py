"""
Pretrain a deliberately tiny GPT on the best-fit loader, with checkpoints you can kill and resume:
the proof that the data pipeline resumes. Train 12 steps straight, or stop after step 6 and resume
from its checkpoint, and the losses of steps 7..12 are the same floats (on the CPU; GPU kernels may
pick non-deterministic algorithms, so expect agreement to a few decimals there).

    python -m scripts.base_train --depth 2 --width 64 --heads 4 --B 8 --T 128 --steps 200 \\
        --save-every 50 --eval-every 50
    python -m scripts.base_train ... --resume-from-step 100       # carries on with step 101
    torchrun --nproc_per_node=2 -m scripts.base_train ...        # gloo on CPU, nccl on GPUs

A checkpoint, <checkpoint-dir>/step_{step:06d}.pt, holds the model, the optimizer, the RNG and every
rank's loader state (`dataloader_state_dicts`), so one file resumes the whole job, at another world
size too (nanochat.resume.merge_states). It loads with weights_only=True.
"""

import argparse
import itertools
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from nanochat.data.base.cli import run
from nanochat.common import get_base_dir, get_dist_info, print0
from nanochat.dataloader import (tokenizing_distributed_data_loader_bos_bestfit,
                                 tokenizing_distributed_data_loader_with_state_bos_bestfit)
from nanochat.resume import merge_states
from nanochat.tokenizer import RustBPETokenizer, get_token_bytes, get_tokenizer_dir

IGNORE_INDEX = -100  # targets with this value (e.g. masked-out positions) carry no loss

# -----------------------------------------------------------------------------
# The model: a tiny GPT


def norm(x: torch.Tensor) -> torch.Tensor:
    # parameter-free RMSNorm, as nanochat: one less thing to save, nothing to tune
    return F.rms_norm(x, (x.size(-1),))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each added to the
    residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.attn_proj = nn.Linear(width, width, bias=False)
        self.fc = nn.Linear(width, 4 * width, bias=False)
        self.mlp_proj = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(norm(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        x = x + self.mlp_proj(F.relu(self.fc(norm(x))).square())  # relu^2, as nanochat
        return x


class GPT(nn.Module):
    """Token + learned position embeddings, `depth` blocks, a final norm and an untied lm head.
    Small on purpose, to exercise data, checkpoints and evaluation: its parameters are mostly the
    embedding and the head, 2 * vocab * width (8.4M at a 65,536 vocab and width 64)."""

    def __init__(self, vocab_size: int, sequence_len: int, depth: int, width: int, heads: int):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, width)
        self.wpe = nn.Embedding(sequence_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.lm_head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor,
                reduction: str = "mean") -> torch.Tensor:
        """idx, targets: (B, T) int64 -> the cross-entropy loss in nats (per token, (B*T,), if
        reduction="none"; 0 where the target is IGNORE_INDEX)."""
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(norm(x)).float()  # the loss in float32, whatever the weights
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction=reduction)


# -----------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate(model: GPT, val_loader, num_batches: int, token_bytes: torch.Tensor,
             ddp: bool) -> dict:
    """Mean loss (nats per target token) and bits per byte over num_batches val batches (per rank).

    bpb = sum of the losses of targets that stand for bytes / (ln 2 * their bytes), as nanochat's
    evaluate_bpb: targets that are IGNORE_INDEX or special tokens (0 bytes) count in neither, so the
    number does not depend on the tokenizer's vocabulary size."""
    model.eval()
    device = token_bytes.device
    # [sum of losses, targets, sum of losses of byte targets, bytes]
    totals = torch.zeros(4, dtype=torch.float32, device=device)
    for inputs, targets in itertools.islice(val_loader, num_batches):
        losses = model(inputs, targets, reduction="none")
        targets = targets.reshape(-1)
        valid = targets != IGNORE_INDEX
        # clamp: -100 cannot index token_bytes; where() zeroes those targets anyway
        num_bytes = torch.where(valid, token_bytes[targets.clamp(min=0)], 0)
        totals += torch.stack([losses.sum(), valid.sum().float(), (losses * (num_bytes > 0)).sum(),
                               num_bytes.sum().float()])
    if ddp:
        dist.all_reduce(totals)  # sums first, then one division: every rank gets the same figure
    model.train()
    loss_sum, num_targets, byte_loss_sum, num_bytes = totals.tolist()
    return {"loss": loss_sum / max(1.0, num_targets),
            "bpb": byte_loss_sum / (math.log(2) * max(1.0, num_bytes))}  # nats -> bits


# -----------------------------------------------------------------------------
# Checkpoints


def checkpoint_path(checkpoint_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir, f"step_{step:06d}.pt")


def save_checkpoint(path: str, checkpoint: dict) -> None:
    """Write to path.tmp, flush it to disk, then rename: a kill leaves the old file or the new
    one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
        os.replace(tmp, path)
    except BaseException:  # Ctrl-C too: no temporary file is left behind
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_checkpoint(path: str, model_config: dict) -> dict:
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint {path}; pick a step that was saved (--save-every) "
                                "or check --checkpoint-dir")
    # weights_only: a checkpoint runs no code when loaded; map to CPU, the caller moves it
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if checkpoint["model_config"] != model_config:
        raise ValueError(f"{path} was saved with model config {checkpoint['model_config']}, "
                         f"this run has {model_config}; pass the same --depth/--width/--heads/--T")
    return checkpoint


def loader_resume_state(states: list[dict], rank: int, world_size: int,
                        data_dir: str | None) -> dict:
    """This rank's loader state: its own when the world size is unchanged, else the merge of every
    saved rank's state for the new world size (elastic resume: each rank merges the same states,
    gets the same result, and the loader picks this rank's part)."""
    if len(states) == world_size:
        return states[rank]
    print0(f"world size changed from {len(states)} to {world_size}: merging the loader states")
    return merge_states(states, world_size, data_dir=data_dir)


# -----------------------------------------------------------------------------
# Training


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m scripts.base_train",
        description="Pretrain a tiny GPT on the best-fit loader, resumably")
    parser.add_argument("--data-dir", default=None,
                        help="parquet shards (default: the dataset's directory)")
    parser.add_argument("--tokenizer-dir", default=None, help="default: <base_dir>/tokenizer")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--depth", type=int, default=2, help="transformer blocks (default: 2)")
    parser.add_argument("--width", type=int, default=64, help="model width (default: 64)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")
    parser.add_argument("--B", type=int, default=8, help="rows per batch and rank (default: 8)")
    parser.add_argument("--T", type=int, default=128, help="tokens per row (default: 128)")
    parser.add_argument("--buffer-size", type=int, default=1000,
                        help="loader documents to pick from (default: 1000)")
    parser.add_argument("--long-doc-policy", default="crop",
                        choices=["crop", "split", "split_reuse"],
                        help="train loader: what to do with tokens that do not fit a row (default: "
                             "crop, nanochat's)")
    parser.add_argument("--split-overlap", type=int, default=0,
                        help="tokens a piece of a split document repeats from the piece before "
                             "(targets masked)")
    parser.add_argument("--steps", type=int, default=100,
                        help="optimizer steps in all (default: 100)")
    parser.add_argument("--lr", type=float, default=3e-3,
                        help="AdamW learning rate (default: 3e-3)")
    parser.add_argument("--seed", type=int, default=42, help="seeds the model init (default: 42)")
    parser.add_argument("--eval-every", type=int, default=25,
                        help="val loss and bpb every N steps and at the end")
    parser.add_argument("--eval-batches", type=int, default=4,
                        help="val batches per evaluation (default: 4)")
    parser.add_argument("--save-every", type=int, default=0,
                        help="checkpoint every N steps (default: 0 = never)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="default: <base_dir>/base_checkpoints")
    parser.add_argument("--resume-from-step", type=int, default=None,
                        help="load step_{S:06d}.pt, go on with S+1")
    parser.add_argument("--stop-after-step", type=int, default=None,
                        help="stop after this step without the final evaluation, as if killed")
    parser.add_argument("--log-json", default=None,
                        help='write {"losses": {step: loss}, "val": {step: {"loss", "bpb"}}, '
                             '...} here')
    args = parser.parse_args(argv)
    for name in ("depth", "width", "heads", "B", "T", "buffer_size", "steps", "eval_every",
                 "eval_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.width % args.heads:  # each head takes width / heads channels
        parser.error(f"--width ({args.width}) must be divisible by --heads ({args.heads})")
    if args.save_every < 0:
        parser.error(f"--save-every must be >= 0, got {args.save_every}")
    if args.resume_from_step is not None and not 0 < args.resume_from_step < args.steps:
        parser.error(f"--resume-from-step must be in [1, {args.steps}), got "
                     f"{args.resume_from_step}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ddp, rank, local_rank, world_size = get_dist_info()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if ddp:
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
        if device == "cuda":
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
    tokenizer_dir = get_tokenizer_dir() if args.tokenizer_dir is None else args.tokenizer_dir
    checkpoint_dir = (os.path.join(get_base_dir(), "base_checkpoints")
                      if args.checkpoint_dir is None else args.checkpoint_dir)
    for name, value in vars(args).items():
        print0(f"{name}: {value}")
    print0(f"using device {device}, world size {world_size}")

    tokenizer = RustBPETokenizer.from_directory(tokenizer_dir)
    token_bytes = get_token_bytes(device=device, tokenizer_dir=tokenizer_dir)
    model_config = {"vocab_size": tokenizer.get_vocab_size(), "sequence_len": args.T,
                    "depth": args.depth, "width": args.width, "heads": args.heads}
    # every rank draws the same init from the same seed, so no broadcast is needed under torchrun
    torch.manual_seed(args.seed)
    model = GPT(**model_config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    print0(f"parameters: {sum(p.numel() for p in model.parameters()):,}")

    start_step, loader_state = 0, None
    if args.resume_from_step is not None:
        path = checkpoint_path(checkpoint_dir, args.resume_from_step)
        checkpoint = load_checkpoint(path, model_config)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        # the CPU generator as saved: a resumed run draws what an unbroken run would
        torch.set_rng_state(checkpoint["rng_state"])
        start_step = checkpoint["step"]
        loader_state = loader_resume_state(checkpoint["dataloader_state_dicts"], rank, world_size,
                                           args.data_dir)
        print0(f"resumed from {path}: continuing with step {start_step + 1}")

    loader_kwargs = dict(device=device, buffer_size=args.buffer_size, data_dir=args.data_dir)
    train_loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tokenizer, args.B, args.T, "train", resume_state_dict=loader_state,
        long_doc_policy=args.long_doc_policy, split_overlap=args.split_overlap, **loader_kwargs)
    log = {"losses": {}, "val": {}, "buffer_docs": {}}

    def run_eval(step):
        # a fresh val loader each time, so every evaluation sees the same batches
        val_loader = tokenizing_distributed_data_loader_bos_bestfit(tokenizer, args.B, args.T,
                                                                    "val", **loader_kwargs)
        result = evaluate(model, val_loader, args.eval_batches, token_bytes, ddp)
        val_loader.close()  # stops its background threads before the next one starts
        log["val"][step] = result
        print0(f"step {step:5d} | val loss {result['loss']:.6f} | val bpb {result['bpb']:.6f} | "
               f"val loss {result['loss']!r}")

    stopped = False
    for step in range(start_step + 1, args.steps + 1):
        t0 = time.perf_counter()
        inputs, targets, loader_state = next(train_loader)
        loss = model(inputs, targets)
        loss.backward()
        if ddp:
            # average gradients by hand instead of wrapping in DDP: fewer moving parts, same math
            # (SUM then divide: gloo has no AVG)
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world_size
            loss = loss.detach().clone()  # all_reduce works in place: not on the graph's tensor
            dist.all_reduce(loss)
            loss /= world_size
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.item()
        dt = time.perf_counter() - t0
        buffer_docs = train_loader.stats.get("buffer_docs")
        log["losses"][step] = loss
        log["buffer_docs"][step] = buffer_docs
        print0(f"step {step:5d}/{args.steps} | loss {loss:.6f} | {dt * 1000:.0f} ms | "
               f"{args.B * args.T * world_size / dt:,.0f} tok/s | buffer docs {buffer_docs} | "
               f"loss {loss!r}")
        # the loader since the last step: next()'s wait, tokens/s, crop, masked, documents per row
        print0(train_loader.figures().line())

        if step % args.eval_every == 0 or step == args.steps:
            run_eval(step)
        if args.save_every and step % args.save_every == 0:
            # one file for the job: every rank's loader state, gathered to rank 0
            states = [None] * world_size
            if ddp:
                dist.all_gather_object(states, loader_state)
            else:
                states = [loader_state]
            if rank == 0:
                path = checkpoint_path(checkpoint_dir, step)
                save_checkpoint(path, {"step": step, "model": model.state_dict(),
                                       "optimizer": optimizer.state_dict(),
                                       "dataloader_state_dicts": states,
                                       "rng_state": torch.get_rng_state(),
                                       "model_config": model_config})
                print0(f"saved {path}")
        if args.stop_after_step is not None and step >= args.stop_after_step:
            print0(f"stopping after step {step} (--stop-after-step), as if killed")
            stopped = True
            break
    train_loader.close()

    if rank == 0 and args.log_json:
        log["stopped"] = stopped
        with open(args.log_json, "w") as f:
            json.dump(log, f)  # json writes floats with repr, so they read back bit for bit
    print0(json.dumps({"final_step": step, "stopped": stopped, "loss": log["losses"][step],
                       "val": log["val"].get(step)}))
    if ddp:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run(main, "training stopped; every checkpoint it saved (--save-every) is whole: rerun with "
              "--resume-from-step and the last step saved to go on from there")

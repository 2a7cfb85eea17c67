"""
Data mixtures and curricula over pretokenized buckets (GPT-Simple's layout and rules).
The public mixture loader and `python -m nanochat.mixture validate`. Every row of a batch comes
whole from one bucket; which bucket is a counter-based function of (seed, phase, rank, position),
so a resume continues the mix exactly. A bucket that runs dry stops every rank at the same step
(BucketExhausted, with the last good state), or is dropped (allow_bucket_exhaustion=True). The work
is in nanochat/data/mixtures/: the plan made at the call (mixture_plan.py), the draw of rows
(mix.py), the stops (stops.py), curricula (curriculum.py), the state (mixture_state.py). Design:
docs/mixtures.md.

    python -m nanochat.mixture validate CONFIG --data DATA_DIR [--tokens N] [--split train]

May import: nanochat.data.base, nanochat.data.loader.build, nanochat.data.mixtures.
"""

import argparse
import functools
import sys
from typing import NamedTuple

from nanochat.data.base.checks import check_options, resolve_workers
from nanochat.data.base.cli import run
from nanochat.data.base.packing import POLICIES, BestFitPacker
from nanochat.data.base.shuffle import Shuffle
from nanochat.data.loader.build import (DataLoader, DeviceBatches, LoaderSpec, Prepared, Run, Walk,
                                        assemble, make_loader, row_split, start_counters,
                                        sum_counters)
from nanochat.data.mixtures.curriculum import dry_fixes, validate
from nanochat.data.mixtures.mix import mixture_batches
from nanochat.data.mixtures.mixture_plan import MixtureOptions, MixturePlan, plan_mixture
from nanochat.data.mixtures.stops import (FAILED, STOP_CODES, BucketExhausted, CurriculumComplete,
                                          MixtureStop, agree, dry_message, flag_group)


def pretokenized_mixture_loader_with_state_bos_bestfit(
        B: int, T: int, split: str, curriculum, device="cuda",
        resume_state_dict: dict | None = None, buffer_size: int = 1000, *, data_dir: str,
        seed: int = 0, bos_token: int | None = None, chunk_size: int = 1024,
        batch_size: int = 128, rank: int | None = None, world_size: int | None = None,
        prefetch: int = 4, with_state: bool = True, allow_state_mismatch: bool = False,
        allow_bucket_exhaustion: bool = False, allow_budget_mismatch: bool = False,
        total_tokens: int | None = None, trace_documents: bool = False,
        long_doc_policy: str = "crop", split_overlap: int = 0, vocab_size: int | None = None,
        shuffle: bool = False, shuffle_window: int = 8,
        workers: int | None = None) -> "MixtureLoader":
    """Yield (inputs, targets, state_dict): best-fit rows, each from one bucket of
    data_dir/split/<bucket>/, mixed by the curriculum. buffer_size is per bucket. seed picks the
    mix's sequence. total_tokens: tokens the run will train (all ranks), checked against the
    curriculum. vocab_size, bos_token: as for the pretokenized loader; pretokenize.json is looked
    for in data_dir and in each bucket's directory (all that record a BOS must agree). shuffle,
    shuffle_window: each bucket's chunks and entries in a seeded order (seed and the bucket's name).
    Raises BucketExhausted / CurriculumComplete (with .state, the last good state) where it must
    stop. A fresh loader checks the curriculum against the buckets first, their crop under T and
    long_doc_policy estimated: a ValueError for a shortfall of tokens, a logged warning (at the
    call) for a bucket that cropping will run dry. workers: as for the parquet loader (the stop is
    agreed here, in the trainer's process). Details: docs/mixtures.md."""
    options = MixtureOptions(**locals())
    workers = resolve_workers(workers, prefetch)
    if workers:  # (B, T: the size of the worker's shared memory)
        check_options(B, T, split, prefetch)
    return make_loader(MixtureLoader, Run(B, T, split, device, prefetch, with_state, workers),
                       lambda: _prepare(options))


def pretokenized_mixture_loader_bos_bestfit(*args, **kwargs):
    """Like pretokenized_mixture_loader_with_state_bos_bestfit, yielding (inputs, targets)."""
    return pretokenized_mixture_loader_with_state_bos_bestfit(*args, with_state=False, **kwargs)


def _prepare(options: MixtureOptions) -> Prepared:
    """The mixture's plan (every argument and the state checked, at the call), each bucket's walk
    as a LoaderSpec, and how to build the loader, here or (pickled) in a worker process."""
    o = options
    plan = plan_mixture(o)
    walks = [Walk(LoaderSpec(kind="bestfit", reader=b.reader, encoder=plan.encoder,
                             config=b.config, rank=plan.rules.rank,
                             world_size=plan.rules.world_size, batch_size=o.batch_size, B=o.B,
                             T=o.T, buffer_size=o.buffer_size, shuffle=b.shuffle,
                             allow_state_mismatch=o.allow_state_mismatch, epochs=1,
                             state_name=b.state_name), b.state)
             for b in plan.buckets]
    mix = MixtureSpec({b.name: walk for b, walk in zip(plan.buckets, walks)}, plan,
                      (o.long_doc_policy, o.split_overlap), o.trace_documents, o.prefetch,
                      o.with_state)
    return Prepared(walks, functools.partial(_build_mixture, mix))


class MixtureSpec(NamedTuple):
    """What the mixture loader is built from, here or (pickled) in a worker process."""
    walks: dict  # bucket -> its Walk
    plan: MixturePlan
    policy: tuple[str, int]  # (long_doc_policy, split_overlap)
    trace_documents: bool
    prefetch: int
    with_state: bool


def _build_mixture(mix: MixtureSpec, device) -> "MixtureLoader":
    plan, (B, T) = mix.plan, (mix.plan.rules.B, mix.plan.rules.T)
    buckets = {name: (assemble(spec, state), BestFitPacker(T + 1, *mix.policy))
               for name, (spec, state) in mix.walks.items()}
    batches = mixture_batches(plan.phases, buckets, plan.rules, plan.config, plan.state,
                              mix.trace_documents)
    return MixtureLoader(batches, DeviceBatches(B, T, device), row_split, mix.prefetch,
                         mix.with_state, start_state=plan.state, world_size=plan.rules.world_size,
                         fixes=dry_fixes(T, mix.policy[0]),
                         start_counters=start_counters("bestfit", [
                             parts.recorder for parts, _ in buckets.values()]))


class MixtureLoader(DataLoader):
    """The DataLoader of pretokenized_mixture_loader...: stops, on every rank at the same step, with
    BucketExhausted or CurriculumComplete. `stats` adds the phase, tokens done, dropped buckets,
    per-bucket statistics, and `row_buckets` (each row's bucket in the last batch)."""

    def __init__(self, *args, start_state=None, world_size=1, fixes="", **kwargs):
        super().__init__(*args, **kwargs)
        self.last_state = start_state
        self._fixes = fixes  # what BucketExhausted's message suggests (curriculum.dry_fixes)
        # Looked up at each step, never kept: a loader held until the interpreter's exit (in a
        # reference cycle, or never closed) would keep a gloo group alive after
        # destroy_process_group(), and its worker thread then frees the flag tensors while Python
        # is shutting down, which aborts the process.
        self._world_size = world_size
        flag_group(world_size)  # made now, on every rank in the same order
        self._told_failure = False

    def __next__(self):
        try:
            return super().__next__()
        except MixtureStop:
            raise
        except Exception:
            if not self._told_failure:  # pair with the other ranks' flag exchange of this step
                self._told_failure = True
                agree(FAILED, self._world_size)
            raise

    def worker_info(self) -> dict:
        return super().worker_info() | {"extras": {"start_state": self.last_state,
                                                   "world_size": self._world_size,
                                                   "fixes": self._fixes}}

    def _packer_counters(self, batch) -> dict:
        return sum_counters(state["counters"] for state in batch.state["buckets"].values())

    def _check(self, batch) -> None:
        stop = batch.stop
        code = agree(STOP_CODES[stop.kind if stop else None], self._world_size)
        if not code:
            self.last_state = batch.state
        if code == FAILED:
            self._told_failure = True
            raise RuntimeError("the mixture loader failed on another rank (see its error); "
                               "stopping here too")
        if code == STOP_CODES["bucket"]:
            raise BucketExhausted(dry_message(stop, batch.stats.get("buckets", {}), self._fixes),
                                  self.last_state, stop.bucket if stop else None)
        if code == STOP_CODES["budget"]:
            raise CurriculumComplete("every phase of the curriculum is done; its `state` is the "
                                     "last good state (pass allow_budget_mismatch=True to go on "
                                     "with the last phase)", self.last_state)


# -----------------------------------------------------------------------------
# python -m nanochat.mixture validate CONFIG --data PATH [--tokens N]


def _positive(text: str) -> int:
    value = int(text.replace("_", ""))  # 5_000_000 reads as in Python and YAML
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nanochat.mixture",
                                     description="Check a curriculum against the buckets on disk.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "validate", help="tokens demanded vs available per phase and bucket; exit 1 on a blocking "
                         "problem",
        description="Check a curriculum against the pretokenized buckets in --data before a run. "
                    "Prints, per phase and bucket, the tokens the phase demands, those the bucket "
                    "holds (and the smallest rank's share, with --world-size), and with --T what "
                    "cropping long documents costs. A bucket that runs dry or a --tokens budget "
                    "the phases do not add up to is a blocking problem (the --allow-* flags make "
                    "it a warning). Exits 0 when there is none, 1 when there is one, 2 on bad "
                    "input.")
    check.add_argument("config", help="curriculum file (.yaml/.yml/.json): a list of phases or "
                                      "{curriculum: [...]}")
    check.add_argument("--data", required=True,
                       help="the data directory holding <split>/<bucket>/ shards")
    check.add_argument("--split", default="train", choices=["train", "val"])
    check.add_argument("--tokens", type=_positive, default=None,
                       help="tokens the run will train (all ranks)")
    check.add_argument("--T", type=_positive, default=None,
                       help="the loader's T: a row of T+1 tokens trains T")
    check.add_argument("--B", type=_positive, default=None,
                       help="the loader's B (with --T: the step, the budget's tolerance)")
    check.add_argument("--world-size", type=_positive, default=1,
                       help="ranks: each must hold its share (default 1)")
    check.add_argument("--chunk-size", type=_positive, default=1024,
                       help="the loader's chunk_size (default 1024)")
    check.add_argument("--long-doc-policy", default="crop", choices=POLICIES,
                       help="the loader's long_doc_policy (default crop: with --T, each bucket's "
                            "crop is estimated)")
    check.add_argument("--strict", action="store_true",
                       help="a bucket that the estimated crop runs dry is an error, not a warning")
    check.add_argument("--shuffle", action="store_true",
                       help="the loader shuffles (shuffle=True): ranks get other chunks")
    check.add_argument("--seed", type=int, default=0,
                       help="the loader's seed (with --shuffle; default 0)")
    check.add_argument("--shuffle-window", type=_positive, default=8,
                       help="the loader's shuffle_window (default 8)")
    check.add_argument("--allow-bucket-exhaustion", action="store_true",
                       help="a predicted shortfall only warns")
    check.add_argument("--allow-budget-mismatch", action="store_true",
                       help="a budget mismatch only warns")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        # one step of all ranks: the budget's tolerance (0 without --B and --T: exact)
        step = args.B * args.T * args.world_size if args.B and args.T else 0
        lines, problems, notes = validate(
            args.config, args.data, args.split, total_tokens=args.tokens,
            allow_bucket_exhaustion=args.allow_bucket_exhaustion,
            allow_budget_mismatch=args.allow_budget_mismatch, T=args.T,
            world_size=args.world_size, chunk_size=args.chunk_size, step_tokens=step,
            shuffle=Shuffle(args.seed, args.shuffle_window) if args.shuffle else None,
            long_doc_policy=args.long_doc_policy, strict=args.strict)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    per_rank = args.world_size > 1  # the column only means something with several ranks
    print(f"{'phase':>5s}  {'bucket':16s} {'weight':>7s} {'demanded':>16s} "
          f"{'demanded so far':>16s} {'available':>16s}"
          + (f" {'smallest rank share':>20s}" if per_rank else "")
          + f" {'usable':>16s} {'crop':>5s}  status")
    for r in lines:
        crop = "-" if r["crop_share"] is None else f"{r['crop_share']:.2f}"
        print(f"{r['phase']:5d}  {r['bucket']:16s} {r['weight']:7.3f} {r['demanded']:16,d} "
              f"{r['demanded_so_far']:16,d} {r['available']:16,d}"
              + (f" {r['smallest_rank_share']:20,d}" if per_rank else "")
              + f" {r['usable']:16,d} {crop:>5s}  {r['status']}")
    if args.T is None and args.long_doc_policy == "crop":
        print("crop not estimated: give --T (and --long-doc-policy) to count it")
    for note in notes:
        print(f"warning: {note}")
    for problem in problems:
        print(f"error: {problem}")
    print("blocking problems: " + (str(len(problems)) if problems else "none"))
    return 1 if problems else 0


INTERRUPTED = "validate stopped; it only reads: rerun it"  # what Ctrl-C prints (cli.run)


if __name__ == "__main__":
    run(main, INTERRUPTED)

"""
One pretokenize run, from its checked arguments to the pairs on disk.
One pretokenize run, from its checked arguments to the pairs on disk: plan the job's units (the
output checked, its settings recorded) and take this rank's share, hold the output's lock, then
write the pairs not yet written on an executor (this machine's worker processes, or a Ray cluster),
with a progress bar and a summary line. Cost: one tokenizer pass over the inputs.

May import: nanochat.data.base, nanochat.data.processing.inputs,
nanochat.data.processing.output_lock, nanochat.data.processing.pair_workers,
nanochat.data.processing.ray_executor, nanochat.data.processing.units.
"""

import os
import time
from dataclasses import dataclass

from nanochat.data.base.checks import rank_cpus
from nanochat.data.base.files import progress_bar
from nanochat.data.processing.output_lock import output_lock
from nanochat.data.processing.pair_workers import pair_results
from nanochat.data.processing.ray_executor import ray_results
from nanochat.data.processing.inputs import check_parts
from nanochat.data.processing.units import PretokenizeJob, plan_units

EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class PretokenizeRun:
    """A run's arguments, checked (python -m nanochat.pretokenize's flags): the job, and where it
    runs."""
    job: PretokenizeJob
    num_workers: int  # local: processes tokenizing units in parallel (1: this process)
    rank: int  # local: this process takes units rank, rank + world_size, ...
    world_size: int
    lock_timeout: float
    executor: str = "local"  # or "ray": the whole job as Ray tasks
    ray_address: str | None = None  # a Ray cluster's address; None: start a local one


def run_pretokenize(run: PretokenizeRun) -> int:
    """Write this rank's pairs; 0, or 1 when a unit failed (the others are still written)."""
    job = run.job
    units = plan_units(job)
    mine = units[run.rank::run.world_size]  # ranks share the work without talking to each other
    home = job.output if job.bucket is None else os.path.join(job.output, "train", job.bucket)
    # a second run of this rank would write the same pairs: refused (the lock is taken after every
    # check, so a mistyped command never waits for it). Other runs on this output (a plain run
    # beside ranks) may still share a pair: tokenize_pair.pair_lock keeps its writers apart
    with output_lock(home, run.rank, run.world_size, run.lock_timeout):
        check_parts(units)  # again: a run of this rank that held the lock may have split otherwise
        todo = [unit for unit in mine if not os.path.exists(unit.prefix + ".idx")]  # a whole pair
        skipped = len(mine) - len(todo)
        inputs = len({unit.source for unit in units})
        share = (f"{len(mine)} for rank {run.rank}/{run.world_size}" if run.world_size > 1
                 else f"{len(mine)} for this run")
        print(f"{inputs} inputs in {len(units)} units of work, {share}; {skipped} already done "
              f"(their .idx exists), skipped; {len(todo)} to write on {_where(run)}")
        return _write(run, todo, skipped, len(mine))


def _where(run: PretokenizeRun) -> str:
    if run.executor == "ray":
        address = run.ray_address or os.environ.get("RAY_ADDRESS")
        return f"Ray ({address or 'a cluster on this machine'})"
    return f"{run.num_workers} process" + ("es" if run.num_workers > 1 else "")


def _results(run: PretokenizeRun, todo: list):
    """Each unit's PairResult, in completion order, from the run's executor."""
    if run.executor == "ray":
        return ray_results(run.job, todo, run.ray_address)
    num_workers = min(run.num_workers, len(todo))
    # spread the CPUs this process may use between processes; each process's tokenizer encodes a
    # batch on this many threads
    num_threads = max(1, rank_cpus() // max(1, num_workers))
    return pair_results(run.job, todo, num_workers, num_threads)


def _write(run: PretokenizeRun, todo: list, skipped: int, total: int) -> int:
    """Write the pairs of todo behind a progress bar (total: this rank's units, of which skipped
    were done before), then print the summary; 1 if one failed."""
    totals = {"documents": 0, "entries": 0, "tokens": 0, "windowed": 0}
    failed, written = [], 0
    t0 = time.time()
    # a bar on a terminal, a line per quarter in a log
    with progress_bar(total=total, initial=skipped, unit="shard", desc="pretokenize") as bar:
        for path, stats, error in _results(run, todo):
            if error is not None:
                failed.append((path, error))
                bar.write(f"failed: {path}: {error}")  # above the bar, which stays whole
            elif stats is None:  # another run on this output wrote it meanwhile
                skipped += 1
            else:
                written += 1
                for k in totals:
                    totals[k] += stats[k]
            bar.update(1)
            bar.set_postfix(tokens=f"{totals['tokens']:,}")

    seconds = time.time() - t0
    job = run.job
    output_name = job.output if job.bucket is None else f"{job.output} (bucket {job.bucket})"
    print(f"wrote {written}/{len(todo)} shards to {output_name} in {seconds:.1f}s: "
          f"{totals['documents']:,} documents -> {totals['entries']:,} entries, "
          f"{totals['tokens']:,} tokens; {totals['windowed']:,} documents cut into windows; "
          f"{skipped} skipped (already done)")
    if failed:
        names = sorted({os.path.basename(p) for p, _ in failed})
        print(f"failed ({len(failed)}): " + ", ".join(names))
        return 1
    return 0

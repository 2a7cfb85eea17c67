"""
One pretokenize run, from its checked arguments to the pairs on disk.
One pretokenize run, from its checked arguments to the pairs on disk: list the inputs and take this
rank's share, check the output and its recorded settings, hold the output's lock, then write the
pairs not yet written (on worker processes), with a progress bar and a summary line. The caller
loads the tokenizer and says how workers load theirs. Cost: one tokenizer pass over the inputs.

May import: nanochat.data.base.files, nanochat.data.processing.inputs,
nanochat.data.base.layout, nanochat.data.processing.output_lock,
nanochat.data.processing.pair_workers, nanochat.data.processing.settings.
"""

import os
import time
from dataclasses import dataclass

from nanochat.data.base.files import progress_bar
from nanochat.data.processing.inputs import plan_pairs
from nanochat.data.base.layout import check_kind
from nanochat.data.processing.output_lock import output_lock
from nanochat.data.processing.pair_workers import pair_results
from nanochat.data.processing.settings import (check_or_write_settings, check_other_buckets,
                                                 run_settings)


@dataclass(frozen=True)
class PretokenizeRun:
    """A run's arguments, checked (python -m nanochat.pretokenize's flags)."""
    inputs: list[str]
    val_inputs: list[str] | None
    output: str
    bucket: str | None  # a mixture bucket: OUTPUT/<split>/<bucket>/
    tokenizer_file: str  # the file the tokenizer was loaded from (its hash is recorded)
    text_field: str
    max_length: int | None
    overlap: int
    convention: str
    num_workers: int
    rank: int
    world_size: int
    lock_timeout: float


def run_pretokenize(run: PretokenizeRun, tokenizer, load_tokenizer) -> int:
    """Write this rank's pairs; 0, or 1 when an input failed (the others are still written).
    load_tokenizer: a picklable callable that loads the same tokenizer in a worker process."""
    settings = run_settings(tokenizer, run.tokenizer_file, run.max_length, run.overlap,
                            run.convention)
    all_pairs = plan_pairs(run.inputs, run.output, run.val_inputs, run.bucket)
    mine = all_pairs[run.rank::run.world_size]  # ranks share the work without talking to each other
    # never into a directory of another kind of data (parquet shards, a split's or bucket's own
    # pairs, buckets for a plain run, a plain output for a bucket)
    check_kind(run.output, "output" if run.bucket is None else "bucket output")
    # A plain output keeps its settings and locks at its top. A bucket keeps them in its own
    # directories (the lock in train/<bucket>/, the settings in each split's), so that buckets made
    # by separate runs, windowed differently, share one output, and the mixture loader finds each
    # bucket's vocabulary.
    home = run.output if run.bucket is None else os.path.join(run.output, "train", run.bucket)
    settings_dirs = ([run.output] if run.bucket is None
                     else sorted({os.path.dirname(pair.prefix) for pair in all_pairs}))
    if run.bucket is not None:
        check_other_buckets(run.output, run.bucket, settings)
    # a second run of this rank would write the same pairs: refused (the lock is taken after every
    # check, so a mistyped command never waits for it). Other runs on this output (a plain run
    # beside ranks) may still share a pair: tokenize_pair.pair_lock keeps its writers apart
    with output_lock(home, run.rank, run.world_size, run.lock_timeout):
        todo = [pair for pair in mine if not os.path.exists(pair.prefix + ".idx")]  # a whole pair
        skipped = len(mine) - len(todo)
        check_or_write_settings(settings_dirs, settings,
                                "a new --output directory" if run.bucket is None
                                else "another --bucket name (or a new --output directory)")
        print(f"{len(all_pairs)} inputs, {len(mine)} for rank {run.rank}/{run.world_size}; "
              f"{skipped} already done (their .idx exists), skipped; {len(todo)} to write; "
              f"dtype {settings['dtype']}")
        return _write(run, tokenizer, load_tokenizer, todo, skipped, len(mine))


def _write(run: PretokenizeRun, tokenizer, load_tokenizer, todo: list, skipped: int,
           total: int) -> int:
    """Write the pairs of todo behind a progress bar (total: this rank's inputs, of which skipped
    were done before), then print the summary; 1 if one failed."""
    num_workers = min(run.num_workers, len(todo))
    # spread the CPU between processes; each process's tokenizer encodes a batch on this many
    # threads
    options = {"max_length": run.max_length, "overlap": run.overlap,
               "text_field": run.text_field,
               "num_threads": max(1, (os.cpu_count() or 1) // max(1, num_workers)),
               "convention": run.convention}
    totals = {"documents": 0, "entries": 0, "tokens": 0, "windowed": 0}
    failed, written = [], 0
    t0 = time.time()
    # a bar on a terminal, a line per quarter in a log
    with progress_bar(total=total, initial=skipped, unit="shard", desc="pretokenize") as bar:
        for path, stats, error in pair_results(tokenizer, load_tokenizer, options, todo,
                                               num_workers):
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
    output_name = run.output if run.bucket is None else f"{run.output} (bucket {run.bucket})"
    print(f"wrote {written}/{len(todo)} shards to {output_name} in {seconds:.1f}s: "
          f"{totals['documents']:,} documents -> {totals['entries']:,} entries, "
          f"{totals['tokens']:,} tokens; {totals['windowed']:,} documents cut into windows; "
          f"{skipped} skipped (already done)")
    if failed:
        print(f"failed ({len(failed)}): " + ", ".join(os.path.basename(p) for p, _ in failed))
        return 1
    return 0

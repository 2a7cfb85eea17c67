"""
A pretokenize job and its units of work: the two calls that any engine drives.
A pretokenize job and its units of work: the two calls that any engine drives. plan_units(job)
checks the job's output, records its settings (pretokenize.json) and lists every unit of the job;
tokenize_unit(job, unit) writes one unit's pair, or skips it when it is written already. The
command's processes, its Ray executor, and Dask, Spark or a scheduler of your own call the same
two. A unit's pair is the same bytes wherever and however often it is written, so the units may
run in any order, on any machine that mounts the output. Design: docs/pretokenized.md.

May import: nanochat.data.base.layout, nanochat.data.processing.inputs,
nanochat.data.processing.settings, nanochat.data.processing.tokenize_pair.
"""

import os
import pickle
from dataclasses import dataclass
from typing import Callable

from nanochat.data.base.layout import check_kind
from nanochat.data.processing.inputs import UNIT_MB, PairToWrite, check_parts, plan_pairs
from nanochat.data.processing.settings import (check_or_write_settings, check_other_buckets,
                                                 run_settings)
from nanochat.data.processing.tokenize_pair import PairResult, write_pair


@dataclass(frozen=True)
class PretokenizeJob:
    """What a pretokenize job writes (python -m nanochat.pretokenize's flags that are not about
    where it runs). It pickles, so that an engine can send it with each unit."""
    inputs: list[str]  # a parquet dataset directory or a store's address, or jsonl files and dirs
    output: str
    load_tokenizer: Callable  # picklable, no arguments: loads the tokenizer, once per process
    tokenizer_file: str  # the file it is loaded from (its hash is recorded)
    val_inputs: list[str] | None = None  # jsonl files and directories for val/
    bucket: str | None = None  # a mixture bucket: OUTPUT/<split>/<bucket>/
    text_field: str = "text"
    max_length: int | None = None  # windows of at most this many tokens; None: whole documents
    overlap: int = 0
    convention: str = "nanochat"
    unit_bytes: int | None = UNIT_MB << 20  # split local inputs larger than this; None: never


def plan_units(job: PretokenizeJob) -> list[PairToWrite]:
    """Every unit of work of the job (all ranks'), train then val, each input's parts in order,
    once the output is checked and its settings recorded. Refuses an output of another kind,
    settings other than those recorded there, and a split of an input other than the one its
    written pairs have (ValueError)."""
    settings = run_settings(job_tokenizer(job), job.tokenizer_file, job.max_length, job.overlap,
                            job.convention)
    units = plan_pairs(job.inputs, job.output, job.val_inputs, job.bucket, job.unit_bytes)
    # never into a directory of another kind of data (parquet shards, a split's or bucket's own
    # pairs, buckets for a plain run, a plain output for a bucket)
    check_kind(job.output, "output" if job.bucket is None else "bucket output")
    if job.bucket is not None:
        check_other_buckets(job.output, job.bucket, settings)
    check_parts(units)
    # A plain output keeps its settings at its top. A bucket keeps them in each split's directory,
    # so that buckets made by separate runs, windowed differently, share one output, and the
    # mixture loader finds each bucket's vocabulary.
    settings_dirs = ([job.output] if job.bucket is None
                     else sorted({os.path.dirname(unit.prefix) for unit in units}))
    check_or_write_settings(settings_dirs, settings,
                            "a new --output directory" if job.bucket is None
                            else "another --bucket name (or a new --output directory)")
    return units


def tokenize_unit(job: PretokenizeJob, unit: PairToWrite, num_threads: int = 1) -> PairResult:
    """Write one unit's pair, under its lock: its counts, the error of a bad input (it fails alone,
    never retried), or neither when the pair was written already. num_threads: the tokenizer's
    threads for this unit."""
    options = {"max_length": job.max_length, "overlap": job.overlap,
               "text_field": job.text_field, "num_threads": num_threads,
               "convention": job.convention}
    return write_pair(job_tokenizer(job), options, unit)


# one tokenizer per process: loading it for each unit would read and parse its file every time
_loaded: dict[object, object] = {}


def job_tokenizer(job: PretokenizeJob):
    """The job's tokenizer, loaded on this process's first call, and again for a job with another
    load_tokenizer or a tokenizer file changed since (retrained in place)."""
    try:  # a job sent to this process is a new object each time: its pickle is what stays
        how = pickle.dumps(job.load_tokenizer)
    except (pickle.PicklingError, AttributeError, TypeError):  # (an engine's own pickling)
        how = id(job.load_tokenizer)
    try:
        stat = os.stat(job.tokenizer_file)
        key = (how, job.tokenizer_file, stat.st_mtime_ns, stat.st_size)
    except OSError:  # missing: the load says so, or run_settings does
        key = (how, job.tokenizer_file)
    tokenizer = _loaded.get(key)
    if tokenizer is None:
        tokenizer = job.load_tokenizer()
        _loaded.clear()  # one kept: a process serves one job at a time
        _loaded[key] = tokenizer
    return tokenizer

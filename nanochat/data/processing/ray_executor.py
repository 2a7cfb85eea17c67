"""
The Ray executor: a job's units of work as Ray tasks, on a cluster or on this machine.
`python -m nanochat.pretokenize ... --executor ray [--ray-address ADDR]`: each unit is one Ray task
of one CPU that calls units.tokenize_unit, so the pairs are the local executor's, byte for byte.
Tasks are handed out as CPUs free up, so a slow or dead node holds back only its own units. A task
whose worker process or node dies is run again (MAX_RETRIES); a bad input is a result, not an
exception, and fails once. Every node needs this package and the output's filesystem, mounted at
the same path. Design: docs/pretokenized.md.

May import: ray, nanochat.data.fetch.errors, nanochat.data.processing.inputs,
nanochat.data.processing.tokenize_pair, nanochat.data.processing.units.

Imported only when needed: ray (an extra, for --executor ray).
"""

import os

from nanochat.data.fetch.errors import MissingExtra
from nanochat.data.processing.inputs import unit_name
from nanochat.data.processing.tokenize_pair import PairResult
from nanochat.data.processing.units import PretokenizeJob, tokenize_unit

MAX_RETRIES = 3  # runs again of a task whose worker process or node died (Ray's default)
# tasks handed to Ray ahead of time per CPU of the cluster: each CPU finds its next unit queued,
# and a cluster that grows gets more
AHEAD_PER_CPU = 2


def ray_results(job: PretokenizeJob, units: list, address: str | None = None):
    """The PairResult of each unit, in completion order, from Ray tasks on the cluster at address
    (None: $RAY_ADDRESS, else a new cluster on this machine). A Ray already started in this process
    is used as it is."""
    ray = import_ray()
    if not units:  # nothing to write: no cluster to start
        return
    started = not ray.is_initialized()
    if started:
        address = address or os.environ.get("RAY_ADDRESS") or "local"
        # the workers' log lines stay in the cluster's logs: here they would tear the progress bar
        ray.init(address=address, log_to_driver=False,
                 **({"include_dashboard": False} if address == "local" else {}))
    task = ray.remote(num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False)(_unit_task)
    job_ref = ray.put(job)  # sent once, not with each task
    pending, queue = {}, iter(units)
    try:
        _submit(ray, task, job_ref, queue, pending)
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            unit = pending.pop(ref)
            yield _result(ray, ref, unit)
            _submit(ray, task, job_ref, queue, pending)
    finally:  # Ctrl-C, or the caller stopped: no task goes on writing
        for ref in pending:
            ray.cancel(ref, force=True)
        if started:
            ray.shutdown()


def import_ray():
    """The ray module, or MissingExtra with the pip install."""
    try:
        import ray
    except ImportError:
        raise MissingExtra("--executor ray needs Ray: pip install 'nanochat-data[ray]'") from None
    return ray


def _unit_task(job: PretokenizeJob, unit) -> PairResult:
    """One unit on a Ray worker: one CPU, so one tokenizer thread."""
    return tokenize_unit(job, unit, num_threads=1)


def _submit(ray, task, job_ref, queue, pending: dict) -> None:
    """Hand Ray units from queue until AHEAD_PER_CPU per CPU of the cluster are pending."""
    ahead = AHEAD_PER_CPU * max(1, int(ray.cluster_resources().get("CPU", 1)))
    while len(pending) < ahead:
        unit = next(queue, None)
        if unit is None:
            return
        pending[task.remote(job_ref, unit)] = unit


def _result(ray, ref, unit) -> PairResult:
    """The task's PairResult, or one that says why it has none: its code raised (not retried), or
    its worker died on every try."""
    source = unit_name(unit)
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        return PairResult(source, None, f"the task raised {type(e.cause).__name__}: {e.cause}")
    except ray.exceptions.RayError as e:
        return PairResult(source, None,
                          f"its worker died on each of {MAX_RETRIES + 1} tries ({type(e).__name__})"
                          "; rerun to try it again (written pairs are skipped)")

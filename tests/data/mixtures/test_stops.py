"""
How a mixture loader stops (nanochat/data/mixtures/stops.py): the exceptions and what they carry,
the stop codes (a failure outranks a dry bucket, which outranks the budget), a loader outside a
job agreeing with itself, and BucketExhausted's message for a bucket, a whole phase and another
rank. The agreement between real ranks: tests/test_mixture.py (torchrun). Run:
    python -m pytest tests/data/mixtures/test_stops.py -q
"""

from nanochat.data.loader.rows import Stop
from nanochat.data.mixtures.stops import (FAILED, STOP_CODES, BucketExhausted, CurriculumComplete,
                                          MixtureStop, agree, dry_message, flag_group)


def test_the_exceptions_carry_the_last_good_state():
    state = {"phase": 2}
    dry = BucketExhausted("dry", state, "web")
    assert isinstance(dry, MixtureStop) and isinstance(dry, RuntimeError)
    assert (str(dry), dry.state, dry.bucket) == ("dry", state, "web")
    done = CurriculumComplete("done", None)
    assert isinstance(done, MixtureStop) and done.state is None


def test_codes_and_a_loader_outside_a_job():
    # the largest code over the ranks wins: a failure, then a dry bucket, then the budget
    assert STOP_CODES == {None: 0, "budget": 1, "bucket": 2} and FAILED == 3
    assert flag_group(1) is None and flag_group(4) is None  # no process group: no job
    assert [agree(code, 1) for code in range(4)] == [0, 1, 2, 3]


def test_the_dry_message():
    stats = {"web": {"crop_share": 0.25}, "code": {"crop_share": 0.5}}
    fixes = "give the bucket a lower weight or more data"
    end = ("; its `state` is the last good state: save a checkpoint with it and stop, or resume "
           "with allow_bucket_exhaustion=True to drop the bucket. For a run that does not run dry, "
           f"the fixes: {fixes}")
    assert dry_message(Stop("bucket", "code"), stats, fixes) == (
        "bucket 'code' ran dry on this rank (its crop share so far: 0.50)" + end)
    assert dry_message(Stop("bucket"), stats, fixes) == (
        "every bucket of the current phase ran dry on this rank (crop shares so far: code 0.50, "
        "web 0.25)" + end)
    assert dry_message(None, {}, fixes) == (
        "a bucket ran dry on another rank (its message says which)" + end)

"""
The draw of rows (nanochat/data/mixtures/mix.py), driven directly from a plan and each bucket's
walk: every row whole from one bucket (its ids say which) and starting with BOS, the batch's
row_buckets and trace naming it, the state's counters and checksum, the budget's stop with the
last good state, and a bucket that runs dry stopping the draw or dropped with a warning. The mix's
shares over many steps: tests/test_mixture.py. Run:
    python -m pytest tests/data/mixtures/test_mix.py -q
"""

import logging

import numpy as np
import pytest

from conftest import mixture_options, token_bucket
from nanochat.data.base.packing import BestFitPacker
from nanochat.data.loader.rows import Stop
from nanochat.data.mixtures.mix import BucketDoc, BucketPiece, mixture_batches
from nanochat.data.mixtures.mixture_plan import plan_mixture
from nanochat.data.mixtures.mixture_state import mixture_checksum
from nanochat.data.loader.build import LoaderSpec, assemble

B, T, BOS = 2, 31, 1
LOW = {"web": 1000, "code": 2000, "tiny": 3000}  # each bucket's ids: [low, low + 1000)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    token_bucket(root, "web", LOW["web"])
    token_bucket(root, "code", LOW["code"])
    token_bucket(root, "tiny", LOW["tiny"], n_docs=10)  # ~200 tokens: dry within a few rows
    return str(root)


def draw(data_dir, curriculum, trace=False, rules=None, **given):
    """The RowBatch records of the mixture, as its loader draws them (rules: changes to the
    plan's)."""
    plan = plan_mixture(mixture_options(data_dir, curriculum, **given))
    buckets = {}
    for walk in plan.buckets:
        spec = LoaderSpec(kind="bestfit", reader=walk.reader, encoder=plan.encoder,
                          config=walk.config, rank=0, world_size=1, batch_size=128, B=B, T=T,
                          buffer_size=16, shuffle=walk.shuffle, epochs=1,
                          state_name=walk.state_name)
        buckets[walk.name] = (assemble(spec, walk.state), BestFitPacker(T + 1, "crop", 0))
    return mixture_batches(plan.phases, buckets, plan.rules._replace(**rules or {}),
                           plan.config, plan.state, trace)


def bucket_of(row) -> str:
    ids = row[row != BOS]
    names = {name for name, low in LOW.items() if ((ids >= low) & (ids < low + 1000)).any()}
    assert len(names) == 1, f"a row mixes buckets {names}"
    return names.pop()


def test_rows_states_and_the_budgets_stop(data_dir):
    steps = 5
    batches = list(draw(data_dir, [{"tokens": steps * B * T, "mix": {"web": 0.5, "code": 0.5}}],
                        trace=True))
    assert len(batches) == steps + 1
    for k, batch in enumerate(batches[:steps], 1):
        assert batch.rows.shape == (B, T + 1) and (batch.rows[:, 0] == BOS).all()
        assert [bucket_of(row) for row in batch.rows] == batch.stats["row_buckets"]
        # the trace names each row's documents by their bucket
        assert [{entry.bucket for entry in row} for row in batch.trace] == [
            {name} for name in batch.stats["row_buckets"]]
        assert all(isinstance(entry, (BucketDoc, BucketPiece))
                   for row in batch.trace for entry in row)
        state = batch.state
        assert (state["tokens_done"], state["position"], state["emitted"]["batches"]) == (
            k * B * T, k * B, k)
        assert state["checksum"] == mixture_checksum(state) and state["dropped"] == []
    drawn = [name for batch in batches[:steps] for name in batch.stats["row_buckets"]]
    assert set(drawn) == {"web", "code"}
    # every phase's budget trained: a stop, with the last good state
    last = batches[-1]
    assert last.rows is None and last.stop == Stop("budget")
    assert last.state is batches[steps - 1].state


def test_a_bucket_that_runs_dry(data_dir, caplog):
    curriculum = [{"tokens": 40 * B * T, "mix": {"web": 0.5, "tiny": 0.5}}]
    # (the plan refuses what it predicts to run dry: a draw past a wrong prediction is made here
    # by allowing it in the plan and not in the draw)
    batches = list(draw(data_dir, curriculum, allow_bucket_exhaustion=True,
                        rules={"allow_bucket_exhaustion": False}))
    stop = batches[-1]
    assert stop.rows is None and stop.stop == Stop("bucket", "tiny")
    assert stop.state is batches[-2].state and stop.stats["buckets"]["tiny"]["crop_share"] >= 0
    # allowed: the bucket is dropped once, the draw goes on with the others
    caplog.set_level(logging.WARNING)
    batches = list(draw(data_dir, curriculum, allow_bucket_exhaustion=True))
    assert len(batches) == 41 and batches[-1].stop == Stop("budget")
    assert [r.getMessage() for r in caplog.records if r.name == "nanochat.data.mixtures.mix"] == [
        "bucket 'tiny' ran dry on rank 0 in phase 1; dropped, the other weights renormalised "
        "(allow_bucket_exhaustion=True)"]
    assert batches[-2].state["dropped"] == ["tiny"]
    rows = np.concatenate([batch.rows for batch in batches[-6:-1]])
    assert {bucket_of(row) for row in rows} == {"web"}  # after the drop, web alone

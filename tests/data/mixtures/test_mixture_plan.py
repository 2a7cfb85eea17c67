"""
The mixture loader's plan (nanochat/data/mixtures/mixture_plan.py): MixtureOptions names every
argument of the public loader; the plan lists only the buckets the curriculum uses, records the
configuration a resume must match (with "shuffle" only when shuffled), walks each bucket with its
own config and order, and refuses a predicted shortfall (a fresh run) or a budget mismatch (a
resumed one). Small buckets under tmp_path. Run:
    python -m pytest tests/data/mixtures/test_mixture_plan.py -q
"""

import inspect

import pytest

from conftest import mixture_options, token_bucket
from nanochat.data.mixtures.mixture_plan import MixtureOptions, plan_mixture
from nanochat.mixture import pretokenized_mixture_loader_with_state_bos_bestfit as MIX

BOS = 1
CURRICULUM = [{"tokens": 30_000, "mix": {"web": 0.7, "code": 0.3}},
              {"tokens": 20_000, "mix": {"code": 1}}]


def options(data_dir, curriculum=CURRICULUM, **given) -> MixtureOptions:
    return mixture_options(data_dir, curriculum, **given)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    for name, low in (("web", 1000), ("code", 2000), ("math", 3000)):  # math: unused
        token_bucket(root, name, low)
    return str(root)


def test_the_options_name_every_argument():
    assert list(MixtureOptions._fields) == list(inspect.signature(MIX).parameters)


def test_a_fresh_plan(data_dir):
    plan = plan_mixture(options(data_dir, seed=5))
    assert [b.name for b in plan.buckets] == ["code", "web"]  # used only, by name
    assert plan.state is None and [p.tokens for p in plan.phases] == [30_000, 20_000]
    assert plan.rules._asdict() == {"B": 2, "T": 31, "rank": 0, "world_size": 1, "seed": 5,
                                    "buffer_size": 16, "allow_bucket_exhaustion": False,
                                    "allow_budget_mismatch": False}
    config = plan.config
    assert (config["loader"], config["source"], config["tokenizer"]) == (
        "mixture", "pretokenized", "bos:1")
    assert sorted(config["buckets"]) == ["code", "web"] and "shuffle" not in config
    assert config["curriculum"] == [[30_000, [["code", 0.3], ["web", 0.7]]],
                                    [20_000, [["code", 1.0]]]]
    for walk in plan.buckets:
        assert walk.config["split"] == f"train/{walk.name}"
        assert walk.shuffle is None and walk.state is None
        assert walk.state_name == f"resume_state_dict['buckets'][{walk.name!r}]"
    shuffled = plan_mixture(options(data_dir, shuffle=True, shuffle_window=4))
    assert shuffled.config["shuffle"] == {"window": 4}
    assert all(walk.shuffle is not None for walk in shuffled.buckets)


def test_refusals(data_dir):
    with pytest.raises(ValueError, match="the curriculum does not fit the data: phase 1: bucket "
                                         "'web' runs dry"):
        plan_mixture(options(data_dir, curriculum=[{"tokens": 10**6, "mix": {"web": 1}}]))
    with pytest.raises(ValueError, match="unknown bucket 'maths'"):
        plan_mixture(options(data_dir, curriculum=[{"tokens": 10, "mix": {"maths": 1}}]))
    # a resumed run: its state is matched, and a budget mismatch is refused unless allowed
    _, _, state = next(MIX(2, 31, "train", CURRICULUM, data_dir=data_dir, buffer_size=16,
                           chunk_size=32, bos_token=BOS, vocab_size=4000, device="cpu"))
    plan = plan_mixture(options(data_dir, resume_state_dict=state))
    assert plan.state == state and plan.buckets[0].state == state["buckets"]["code"]
    with pytest.raises(ValueError, match="budget mismatch: the curriculum totals 50,000 tokens, "
                                         "the run will train 60,000"):
        plan_mixture(options(data_dir, resume_state_dict=state, total_tokens=60_000))
    assert plan_mixture(options(data_dir, resume_state_dict=state, total_tokens=60_000,
                                allow_budget_mismatch=True)).state == state

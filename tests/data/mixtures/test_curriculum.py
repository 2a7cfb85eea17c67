"""
Curricula (nanochat/data/mixtures/curriculum.py): every error names the phase (counted from 1),
weights that do not sum to 1 are normalised with a warning, and a YAML file (GPT-Simple's shape)
and a JSON one give the same curriculum; the draw's sequence: row_unit is the same for every rank
and run and spreads a job's rows evenly, and choose picks the bucket whose slice holds a point.
validate's counts and messages: tests/test_mixture.py, beside the command that prints them. Run:
    python -m pytest tests/data/mixtures/test_curriculum.py -q
"""

import json

import pytest

from nanochat.data.mixtures.curriculum import choose, load_curriculum, row_unit


def test_curriculum_errors_name_the_phase(tmp_path):
    names = {"web", "code", "math"}
    good = {"tokens": 10, "mix": {"web": 1}}
    for phase, match in [({"tokens": 10, "mix": {"maths": 1}},
                          "curriculum phase 2: unknown bucket 'maths'"),
                         ({"tokens": 10, "mix": {"web": -0.1, "code": 1}},
                          "phase 2: weight of 'web' is -0.1"),
                         ({"tokens": 10, "mix": {}}, "curriculum phase 2: empty mix"),
                         ({"tokens": 0, "mix": {"web": 1}},
                          "curriculum phase 2: 'tokens' must be a positive integer"),
                         ({"tokens": 10, "mix": {"web": 0}},
                          "curriculum phase 2: every weight is 0"),
                         ({"tokens": 10, "weights": {"web": 1}},
                          "curriculum phase 2: unknown keys")]:
        with pytest.raises(ValueError, match=match):
            load_curriculum([good, phase], names)
    with pytest.warns(UserWarning, match="curriculum phase 1: weights sum to 2, normalised to 1"):
        phases = load_curriculum([{"duration_tokens": 10, "mix": {"web": 1.5, "code": 0.5}}],
                                 names)
    assert phases[0].mix == {"code": 0.25, "web": 0.75}
    # files: YAML (GPT-Simple's shape) and JSON give the same curriculum
    (tmp_path / "c.yaml").write_text("data:\n  curriculum:\n    - duration_tokens: 5_000\n"
                                     "      mix: {web: 0.6, code: 0.4}\n")
    (tmp_path / "c.json").write_text(
        json.dumps([{"tokens": 5000, "mix": {"web": 0.6, "code": 0.4}}]))
    assert (load_curriculum(str(tmp_path / "c.yaml"), names)
            == load_curriculum(str(tmp_path / "c.json"), names))


def test_the_draws_sequence():
    # the same point for the same (seed, phase, generation, position, rank): every rank and run
    assert row_unit(0, 1, 0, 5, 1, 2) == row_unit(0, 1, 0, 5, 1, 2)
    assert row_unit(1, 1, 0, 5, 1, 2) != row_unit(0, 1, 0, 5, 1, 2)  # the seed picks the sequence
    # the job's rows are one sequence: row p of rank r is its element p * W + r, so 2 ranks'
    # first 500 rows together are spread as evenly as one rank's first 1,000
    one = sorted(row_unit(7, 0, 0, p, 0, 1) for p in range(1000))
    two = sorted(row_unit(7, 0, 0, p, r, 2) for p in range(500) for r in range(2))
    assert one == pytest.approx(two)
    assert max(b - a for a, b in zip(one, one[1:])) < 0.003  # no gap of more than ~3 rows' share
    weights = [("code", 0.25), ("web", 0.75)]
    assert [choose(weights, u) for u in (0.0, 0.2499, 0.25, 0.9999)] == [
        "code", "code", "web", "web"]
    assert choose(weights, 1.0) == "web"  # within rounding of 1: the last bucket

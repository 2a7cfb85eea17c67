"""
Data mixtures and curricula (nanochat/mixture.py) on generated buckets of known sizes: the
realised mix per phase (every 1M-token window within 1 point of the target, rows checked against
their bucket's tokens), reproducibility, exact resume mid-phase and across a phase boundary,
elastic resume, both exhaustion behaviours (and the ranks of a real torchrun job stopping at the
same step), the budget, curriculum errors, and `python -m nanochat.mixture validate`'s report and
exit codes.
Run: python -m pytest tests/test_mixture.py -q
"""

import json
import os
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO_ROOT, take_tensors, worker_env
from nanochat.data.mixtures.curriculum import bucket_shares, rank_shares, validate
from nanochat.mixture import (BucketExhausted, CurriculumComplete, main as mixture_main,
                              pretokenized_mixture_loader_with_state_bos_bestfit as MIX)
from nanochat.data.pretokenized.token_shards import write_token_shard
from nanochat.resume import merge_states

BOS = 1
# each bucket's tokens come from its own id range, so a row's bucket can be read off its tokens
ID_RANGES = {"code": (1000, 2000), "math": (2000, 3000), "web": (3000, 4000), "tiny": (4000, 5000)}


def make_bucket(root, split, name, n_docs, mean_len, seed, shards=2, fixed_len=None):
    """Shards of n_docs documents of geometric lengths (or all fixed_len), BOS first."""
    rng = np.random.default_rng(seed)
    directory = os.path.join(root, split, name)
    os.makedirs(directory, exist_ok=True)
    low, high = ID_RANGES[name]
    per_shard = -(-n_docs // shards)
    for s in range(shards):
        n = min(per_shard, n_docs - s * per_shard)
        lengths = (np.full(n, fixed_len) if fixed_len
                   else np.maximum(1, rng.geometric(1 / mean_len, size=n)))
        entries = [np.concatenate(([BOS], rng.integers(low, high, size=k - 1))).astype(np.uint16)
                   for k in lengths]
        write_token_shard(os.path.join(directory, f"shard_{s:03d}"), entries, [0] * n, np.uint16)


def bucket_of_row(row) -> str:
    tokens = row[row != BOS]
    names = {name for name, (low, high) in ID_RANGES.items()
             if ((tokens >= low) & (tokens < high)).any()}
    assert len(names) == 1, f"a row mixes buckets {names}"
    return names.pop()


@pytest.fixture(scope="module")
def buckets(tmp_path_factory):
    """web: long documents, code: short ones, math: medium; each far larger than the curriculum
    needs."""
    root = tmp_path_factory.mktemp("mixture")
    for split in ("train", "val"):
        make_bucket(root, split, "web", 9000, 400, 1)
        make_bucket(root, split, "code", 30000, 60, 2)
        make_bucket(root, split, "math", 12000, 150, 3)
    return str(root)


CURRICULUM = [{"tokens": 2_500_000, "mix": {"web": 0.5, "code": 0.3, "math": 0.2}},
              {"tokens": 1_500_000, "mix": {"web": 0.2, "code": 0.5, "math": 0.3}}]
# bos_token: the buckets have no pretokenize.json
KW = dict(device="cpu", buffer_size=64, chunk_size=128, batch_size=32, bos_token=BOS)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_realised_mix_follows_every_phase(buckets, world_size):
    # the job's rows (all ranks, step by step): every 1M-token window inside a phase within 1 point
    B, T = 16, 255
    loaders = [MIX(B, T, "train", CURRICULUM, data_dir=buckets, rank=r, world_size=world_size, **KW)
               for r in range(world_size)]
    rows_by_phase = {1: [], 2: []}
    with pytest.raises(CurriculumComplete) as stop:
        while True:
            for loader in loaders:  # one step: every rank's batch
                x, y, state = next(loader)
                rows = torch.cat([x, y[:, -1:]], dim=1).numpy()
                assert (rows[:, 0] == BOS).all()
                named = [bucket_of_row(row) for row in rows]
                # the reported bucket is the row's real one
                assert named == loader.stats["row_buckets"]
                rows_by_phase[state["phase"]].extend(named)
    # the budget: phases switch at the first step past each budget, and the loader stops past the
    # total
    step = B * T * world_size
    assert stop.value.state["tokens_done"] >= 4_000_000 > stop.value.state["tokens_done"] - step
    for phase, names in rows_by_phase.items():
        mix = CURRICULUM[phase - 1]["mix"]
        window = 1_000_000 // T  # rows of T trained tokens in 1M tokens
        assert len(names) > window
        for bucket, weight in mix.items():
            hits = np.concatenate(([0], np.cumsum([n == bucket for n in names])))
            # every window of 1M tokens in the phase
            shares = (hits[window:] - hits[:-window]) / window
            assert np.abs(shares - weight).max() <= 0.01, \
                (phase, bucket, shares.min(), shares.max())


def test_without_state(buckets):
    from nanochat.mixture import pretokenized_mixture_loader_bos_bestfit
    loader = pretokenized_mixture_loader_bos_bestfit(4, 63, "train", CURRICULUM, data_dir=buckets,
                                                     **KW)
    with_state = MIX(4, 63, "train", CURRICULUM, data_dir=buckets, **KW)
    for _ in range(5):
        batch, (x, y, _) = next(loader), next(with_state)
        assert len(batch) == 2 and torch.equal(batch[0], x) and torch.equal(batch[1], y)


def test_reproducible_and_seeded(buckets):
    def run(seed):
        loader = MIX(4, 63, "train", CURRICULUM, data_dir=buckets, seed=seed, **KW)
        return [next(loader)[0].clone() for _ in range(30)]
    a, b, c = run(0), run(0), run(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("policy", ["crop", "split_reuse"])
def test_exact_resume_mid_phase_and_across_the_boundary(buckets, policy):
    B, T = 8, 127
    short = [{"tokens": 40 * B * T, "mix": {"web": 0.6, "code": 0.4}},
             {"tokens": 40 * B * T, "mix": {"code": 0.3, "math": 0.7}}]
    kw = dict(KW, data_dir=buckets, long_doc_policy=policy,
              split_overlap=2 if policy != "crop" else 0)
    run = take_tensors(MIX(B, T, "train", short, **kw), 70)
    phases = [s["phase"] for _, _, s in run]
    boundary = phases.index(2)
    # the state after a batch names that batch's phase: the 40th batch completes phase 0
    assert boundary == 40 and run[boundary - 1][2]["phase_tokens_done"] == 40 * B * T
    assert run[boundary][2]["phase_tokens_done"] == B * T
    assert all(len(s["buckets"]) == 3 for _, _, s in run)
    for k in (5, boundary - 2, boundary - 1, boundary, 60):
        resumed = MIX(B, T, "train", short, resume_state_dict=json.loads(json.dumps(run[k][2])),
                      **kw)
        for j, (x, y, s) in enumerate(take_tensors(resumed, 69 - k), k + 1):
            assert (torch.equal(x, run[j][0]) and torch.equal(y, run[j][1])
                    and s == run[j][2]), (k, j)


def test_elastic_resume(buckets):
    # 2 ranks for 25 steps, then 3: the phase and the tokens done carry over, the mix goes on, no
    # document is trained on twice (crop: each placed once, whole or cropped), and a state of the
    # merged run resumes exactly
    B, T = 4, 127
    cur = [{"tokens": 2_000_000, "mix": {"web": 0.5, "code": 0.25, "math": 0.25}}]
    kw = dict(KW, data_dir=buckets, trace_documents=True, buffer_size=16)
    placed, states = [], []
    for rank in range(2):
        loader = MIX(B, T, "train", cur, rank=rank, world_size=2, **kw)
        for _ in range(25):
            _, _, state = next(loader)
            placed += [key for row in loader.documents for key in row]
        states.append(state)
    assert all(any(b["buffer"] for b in s["buckets"].values()) for s in states)
    merged = merge_states(states, 3, data_dir=buckets)
    assert [s["tokens_done"] for s in merged["states"]] == [25 * B * T * 2] * 3
    assert all(s["generation"] == 1 and any(b["plan"] for b in s["buckets"].values())
               for s in merged["states"])
    new_rows = []
    for rank in range(3):
        loader = MIX(B, T, "train", cur, rank=rank, world_size=3, resume_state_dict=merged, **kw)
        run = []
        for _ in range(60):
            run.append(take_tensors(loader, 1)[0])
            placed += [key for row in loader.documents for key in row]
            new_rows += loader.stats["row_buckets"]
        assert run[0][2]["tokens_done"] == 25 * B * T * 2 + B * T * 3
        again = MIX(B, T, "train", cur, rank=rank, world_size=3, resume_state_dict=run[9][2],
                    **kw)
        assert all(torch.equal(x, r[0]) and s == r[2]
                   for (x, _, s), r in zip(take_tensors(again, 5), run[10:15]))
    assert len(placed) == len(set(placed)), "a document was trained on twice"
    shares = {name: new_rows.count(name) / len(new_rows) for name in ("web", "code", "math")}
    assert abs(shares["web"] - 0.5) < 0.02 and abs(shares["code"] - 0.25) < 0.02


def tiny_buckets(root):
    """web (plenty) and tiny: 40 documents of 200 tokens (8,000), of which the loader at T=99 crops
    half."""
    make_bucket(root, "train", "web", 4000, 100, 5)
    make_bucket(root, "train", "tiny", 40, 0, 6, shards=1, fixed_len=200)
    return str(root)


TINY_CUR = [{"tokens": 60_000, "mix": {"web": 0.9, "tiny": 0.1}}]


FIXES = ('long_doc_policy="split" (long documents in pieces, not cropped); or pretokenize the '
         'bucket in windows (--max-length 100); or give the bucket a lower weight or more data')
TINY_DRY = ("phase 1: bucket 'tiny' runs dry {when}: 6,061 tokens demanded by the end of the "
            "phase, 8,000 available; rows can take about 4,000 of them: an estimated crop share of "
            "0.50 (long_doc_policy='crop', T=99); fixes: " + FIXES)


def test_bucket_runs_dry_then_resumes_with_it_dropped(tmp_path, caplog):
    data = tiny_buckets(tmp_path)
    kw = dict(device="cpu", buffer_size=4, chunk_size=8, batch_size=4, data_dir=data,
              bos_token=BOS)
    # tiny's 8,000 tokens cover the 6,061 demanded (6,000 x 100/99), but at T=99 each document
    # of 200 keeps one row's 100 at most: 4,000 usable, 40 rows, gone after 39,600 of the job's
    # tokens (40 rows / 0.1 of the rows, 99 trained tokens a row). A warning, not a problem
    rows, problems, notes = validate(TINY_CUR, data, T=99)
    assert not problems and [r["status"] for r in rows] == ["CROP", "ok"]
    assert (rows[0]["usable"], rows[0]["crop_share"]) == (4_000, 0.5)
    assert notes == [TINY_DRY.format(when="after about 39,600 tokens of the job's 60,000")]
    # the loader warns at the call, before any batch: step 101 of 152 (39,600 / 396 a step)
    loader = MIX(4, 99, "train", TINY_CUR, **kw)
    assert [r.getMessage() for r in caplog.records
            if r.name == "nanochat.data.mixtures.mixture_plan"] == [
        "mixture: " + TINY_DRY.format(when="at about step 101 of 152")]
    # and it runs dry there: the loader stops with the last good state, its crop share and fixes
    states = []
    with pytest.raises(BucketExhausted) as stop:
        while True:
            states.append(next(loader)[2])
    assert len(states) + 1 == 101
    assert str(stop.value) == (
        "bucket 'tiny' ran dry on this rank (its crop share so far: 0.50); its `state` is the "
        "last good state: save a checkpoint with it and stop, or resume with "
        "allow_bucket_exhaustion=True to drop the bucket. For a run that does not run dry, the "
        "fixes: " + FIXES)
    assert stop.value.bucket == "tiny" and stop.value.state == states[-1]
    with pytest.raises(BucketExhausted):  # and it stays stopped
        next(loader)
    # resumed with allow_bucket_exhaustion=True: the bucket is dropped, web fills every row from
    # then on
    resumed = MIX(4, 99, "train", TINY_CUR, resume_state_dict=stop.value.state,
                  allow_bucket_exhaustion=True, **kw)
    x, _, state = take_tensors(resumed, 1)[0]
    assert state["dropped"] == ["tiny"] and resumed.stats["dropped"] == ["tiny"]
    for _ in range(5):
        next(resumed)
        assert set(resumed.stats["row_buckets"]) == {"web"}
    # the same run with the flag from the start drops it at the same row and goes on
    straight = MIX(4, 99, "train", TINY_CUR, allow_bucket_exhaustion=True, **kw)
    batches = take_tensors(straight, len(states) + 1)
    assert batches[len(states)][2]["dropped"] == ["tiny"]
    assert torch.equal(batches[len(states)][0], x)


def test_token_ids_are_checked_against_the_vocabulary(tmp_path):
    """A bucket's pretokenize.json gives the vocabulary: a flipped token in that bucket is a
    ValueError naming the shard and entry; buckets whose settings disagree are refused up front."""
    data = tiny_buckets(tmp_path)
    tiny = os.path.join(data, "train", "tiny")
    with open(os.path.join(tiny, "pretokenize.json"), "w") as f:
        json.dump({"vocab_size": 5000}, f)
    bin_path = os.path.join(tiny, "shard_000.bin")
    at = 20 * 200 + 5  # token 5 of entry 20 (every entry of tiny is 200 tokens)
    with open(bin_path, "r+b") as f:
        f.seek(2 * at)
        old = struct.unpack("<H", f.read(2))[0]
        f.seek(2 * at)
        f.write(struct.pack("<H", old ^ 0xFFFF))
    kw = dict(device="cpu", buffer_size=4, chunk_size=8, batch_size=4, data_dir=data, bos_token=BOS,
              allow_bucket_exhaustion=True)
    loader = MIX(4, 99, "train", TINY_CUR, **kw)
    with pytest.raises(ValueError) as info:
        for _ in range(200):
            next(loader)
    assert str(info.value) == (f"{bin_path}: entry 20 holds token id {old ^ 0xFFFF} (token 5 of "
                               f"the entry), outside the vocabulary [0, 5,000) "
                               f"({os.path.join(tiny, 'pretokenize.json')}); the shard is "
                               "damaged or was written with another tokenizer: delete the pair "
                               "and rerun python -m nanochat.pretokenize")
    with open(os.path.join(data, "train", "web", "pretokenize.json"), "w") as f:
        json.dump({"vocab_size": 4096}, f)
    with pytest.raises(ValueError, match=r"^vocab_size 5,000 \(.*tiny/pretokenize.json\) "
                                         r"disagrees with 4,096 \(.*web/pretokenize.json\)"):
        MIX(4, 99, "train", TINY_CUR, **kw)


def test_bos_token_comes_from_pretokenize_json_never_a_guess(tmp_path):
    """Buckets with no pretokenize.json: a ValueError up front that says to pass bos_token= and
    shows the first ids; with one in each bucket's directory, their BOS is the default (and entries
    are checked to start with it); buckets that record different BOS ids are refused."""
    data = tiny_buckets(tmp_path)
    kw = dict(device="cpu", buffer_size=4, chunk_size=8, batch_size=4, data_dir=data,
              allow_bucket_exhaustion=True)
    with pytest.raises(ValueError) as info:
        MIX(4, 99, "train", TINY_CUR, **kw)
    first = os.path.join(data, "train", "tiny", "shard_000.bin")  # the first bucket, by name
    assert str(info.value).startswith(f"no pretokenize.json records the BOS of the shards of "
                                      f"{first} (looked in "
                                      f"{data}, {os.path.join(data, 'train', 'tiny')}, ")
    assert "pass bos_token=" in str(info.value)
    assert str(info.value).endswith(f"Entries 0 to 7 of {first} start with the ids "
                                    f"1, 1, 1, 1, 1, 1, 1, 1.")
    for name in ("tiny", "web"):
        with open(os.path.join(data, "train", name, "pretokenize.json"), "w") as f:
            json.dump({"vocab_size": 5000, "bos_token_id": BOS, "convention": "nanochat"}, f)
    expected = next(MIX(4, 99, "train", TINY_CUR, bos_token=BOS, **kw))[0].clone()
    assert torch.equal(next(MIX(4, 99, "train", TINY_CUR, **kw))[0], expected)
    with open(os.path.join(data, "train", "web", "pretokenize.json"), "w") as f:
        json.dump({"vocab_size": 5000, "bos_token_id": 2}, f)
    with pytest.raises(ValueError, match=r"tiny/pretokenize.json records the nanochat convention "
                                         r"with bos_token_id 1, "
                                         r"but .*web/pretokenize.json the nanochat convention "
                                         r"with bos_token_id 2"):
        MIX(4, 99, "train", TINY_CUR, **kw)


@pytest.mark.slow
def test_a_worker_process_says_the_same(tmp_path):
    # the message is made in the trainer's process, from what the worker sends with the stop
    data = tiny_buckets(tmp_path)
    messages = []
    for workers in (0, 1):
        loader = MIX(4, 99, "train", TINY_CUR, device="cpu", buffer_size=4, chunk_size=8,
                     batch_size=4, data_dir=data, bos_token=BOS, workers=workers)
        assert (loader.worker_pid is not None) == bool(workers)
        with pytest.raises(BucketExhausted) as stop:
            for _ in range(1000):
                next(loader)
        messages.append(str(stop.value))
        loader.close()
    assert messages[0] == messages[1] and "(its crop share so far: 0.50)" in messages[0]


def test_split_runs_what_crop_runs_dry(tmp_path):
    # the same curriculum under long_doc_policy="split": nothing cropped, no warning, every step
    data = tiny_buckets(tmp_path)
    rows, problems, notes = validate(TINY_CUR, data, T=99, long_doc_policy="split")
    assert [(r["status"], r["usable"], r["crop_share"]) for r in rows] == [
        ("ok", 8_000, 0.0), ("ok", rows[1]["available"], 0.0)] and not problems and not notes
    loader = MIX(4, 99, "train", TINY_CUR, device="cpu", buffer_size=4, chunk_size=8,
                 batch_size=4, data_dir=data, bos_token=BOS, long_doc_policy="split")
    steps = 0
    with pytest.raises(CurriculumComplete):
        while True:
            next(loader)
            steps += 1
    assert steps == 152 and loader.stats["buckets"]["tiny"]["tokens_cropped"] == 0


def test_predicted_shortfall_blocks_the_start(tmp_path):
    data = tiny_buckets(tmp_path)
    # 30,000 tokens of tiny: 8,000 exist
    greedy = [{"tokens": 60_000, "mix": {"web": 0.5, "tiny": 0.5}}]
    # 30,303 = 30,000 x 100/99
    with pytest.raises(ValueError, match="phase 1: bucket 'tiny' runs dry at about step 21 of 152: "
                                         "30,303 tokens demanded"):
        MIX(4, 99, "train", greedy, device="cpu", data_dir=data, bos_token=BOS)
    loader = MIX(4, 99, "train", greedy, device="cpu", data_dir=data, bos_token=BOS,
                 allow_bucket_exhaustion=True, buffer_size=4, chunk_size=8, batch_size=4)
    for _ in range(60):
        next(loader)
    assert loader.stats["dropped"] == ["tiny"]


def test_budget(buckets):
    cur = [{"tokens": 10 * 4 * 63, "mix": {"web": 1.0}}]
    with pytest.raises(ValueError, match="budget mismatch: the curriculum totals 2,520 tokens, "
                                         "the run will train 5,000"):
        MIX(4, 63, "train", cur, data_dir=buckets, total_tokens=5000, **KW)
    loader = MIX(4, 63, "train", cur, data_dir=buckets, total_tokens=5000,
                 allow_budget_mismatch=True, **KW)
    # past the curriculum's end: the last phase goes on
    states = [next(loader)[2] for _ in range(15)]
    assert states[-1]["tokens_done"] == 15 * 4 * 63 and states[-1]["phase"] == 1
    loader = MIX(4, 63, "train", cur, data_dir=buckets, **KW)
    states = [next(loader)[2] for _ in range(10)]
    with pytest.raises(CurriculumComplete) as stop:
        next(loader)
    assert stop.value.state == states[-1]


def test_the_loader_names_an_unknown_bucket(buckets):
    # (the curriculum's own errors: tests/data/mixtures/test_curriculum.py)
    with pytest.raises(ValueError, match="unknown bucket 'maths'"):
        MIX(2, 16, "train", [{"tokens": 10, "mix": {"maths": 1}}], data_dir=buckets, **KW)


@pytest.mark.slow
def test_validate_report_and_exit_codes(tmp_path, capsys):
    data = tiny_buckets(tmp_path / "data")
    config = tmp_path / "cur.yaml"
    config.write_text("curriculum:\n  - tokens: 20000\n    mix: {web: 0.8, tiny: 0.2}\n"
                      "  - tokens: 20000\n    mix: {web: 0.9, tiny: 0.1}\n")
    assert mixture_main(["validate", str(config), "--data", data]) == 0
    out = capsys.readouterr().out
    assert "blocking problems: none" in out
    lines = [line.split() for line in out.splitlines() if line.strip().startswith(("1 ", "2 "))]
    assert [(l[0], l[1], l[-1]) for l in lines] == [("1", "tiny", "ok"), ("1", "web", "ok"),
                                                   ("2", "tiny", "ok"), ("2", "web", "ok")]
    assert lines[2][4] == "6,000" and lines[2][5] == "8,000"  # demanded so far, available
    # more of tiny than exists: exit 1 and the shortfall, unless exhaustion is allowed
    config.write_text("curriculum:\n  - tokens: 20000\n    mix: {web: 0.5, tiny: 0.5}\n")
    assert mixture_main(["validate", str(config), "--data", data]) == 1
    assert ("error: phase 1: bucket 'tiny' runs dry after about 16,000 tokens of the job's 20,000: "
            "10,000 tokens demanded" in capsys.readouterr().out)
    assert mixture_main(["validate", str(config), "--data", data, "--allow-bucket-exhaustion"]) == 0
    assert "warning: phase 1: bucket 'tiny' runs dry" in capsys.readouterr().out
    # the budget: --tokens different from the curriculum's total
    config.write_text("curriculum:\n  - tokens: 20000\n    mix: {web: 1}\n")
    assert mixture_main(["validate", str(config), "--data", data, "--tokens", "30000"]) == 1
    assert "budget mismatch" in capsys.readouterr().out
    assert mixture_main(["validate", str(config), "--data", data, "--tokens", "30000",
                         "--allow-budget-mismatch"]) == 0
    # a broken config or data directory: exit 2 with the reason
    config.write_text("curriculum:\n  - tokens: 20000\n    mix: {web: 1, wiki: 1}\n")
    assert mixture_main(["validate", str(config), "--data", data]) == 2
    assert "curriculum phase 1: unknown bucket 'wiki'" in capsys.readouterr().err
    assert mixture_main(["validate", str(config), "--data", str(tmp_path / "nowhere")]) == 2
    config.write_text("curriculum:\n  - tokens: [20000\n")  # broken YAML: exit 2, naming the file
    assert mixture_main(["validate", str(config), "--data", data]) == 2
    assert f"{config} is not valid YAML" in capsys.readouterr().err
    for bad in (["--T", "0"], ["--tokens", "-5"], ["--world-size", "0"]):
        with pytest.raises(SystemExit) as exit_code:
            mixture_main(["validate", str(config), "--data", data, *bad])
        assert exit_code.value.code == 2 and "must be a positive integer" in capsys.readouterr().err
    # and as a module, from a shell
    result = subprocess.run([sys.executable, "-m", "nanochat.mixture", "validate", str(config),
                             "--data", data],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"{config} is not valid YAML" in result.stderr


def run_workers(data, out, mode):
    """tests/mixture_worker.py on 2 real processes (torchrun, gloo); returns both ranks' reports."""
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         os.path.join(REPO_ROOT, "tests", "mixture_worker.py"), data, str(out), mode],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=worker_env(), start_new_session=True)
    try:
        output, _ = job.communicate(timeout=180)
    # a hang is the failure these tests look for: leave no worker behind
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        pytest.fail("the ranks hung (one stopped, the other waited in a collective):\n"
                    + output[-3000:])
    assert job.returncode == 0, output[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_ranks_stop_at_the_same_step(tmp_path):
    # tiny runs dry on one rank first (its share is smaller); both raise BucketExhausted at the
    # same step
    data = tiny_buckets(tmp_path / "data")
    (tmp_path / "out").mkdir()
    reports = run_workers(data, tmp_path / "out", "dry")
    assert reports[0]["step"] == reports[1]["step"] > 1
    # one rank saw it run dry
    assert sorted(r["bucket"] for r in reports if r["bucket"]) == ["tiny"]
    assert all(r["state_is_last"] for r in reports)


@pytest.mark.slow
def test_a_failing_rank_stops_the_others(tmp_path):
    # a read error on rank 1 only: rank 1 raises it, rank 0 raises at the same step instead of
    # hanging
    data = tiny_buckets(tmp_path / "data")
    (tmp_path / "out").mkdir()
    reports = run_workers(data, tmp_path / "out", "fail")
    assert reports[0]["step"] == reports[1]["step"] > 1
    assert "injected read error" in reports[1]["error"]
    assert reports[0]["error"] == "RuntimeError: the mixture loader failed on another rank " \
                                  "(see its error); stopping here too"


def test_merging_twice_deals_nothing_twice(buckets):
    # 2 ranks -> 3 -> 2: the second merge deals what is left of the first (buckets are read once)
    B, T = 2, 63
    cur = [{"tokens": 3_000_000, "mix": {"code": 0.5, "math": 0.5}}]
    kw = dict(KW, data_dir=buckets, trace_documents=True, buffer_size=16)
    placed, resume_from = [], None
    for world_size, steps in [(2, 10), (3, 15), (2, 10)]:
        states = []
        for rank in range(world_size):
            loader = MIX(B, T, "train", cur, rank=rank, world_size=world_size,
                         resume_state_dict=resume_from, **kw)
            for _ in range(steps):
                _, _, state = next(loader)
                placed += [key for row in loader.documents for key in row]
            states.append(state)
        assert all(b["next"][0] <= 2 for s in states for b in s["buckets"].values())
        resume_from = merge_states(states, 3 if world_size == 2 else 2, data_dir=buckets)
        # nothing past the buckets' single pass is ever dealt
        assert all(item["epoch"] == 1 for s in resume_from["states"] for b in s["buckets"].values()
                   for item in b["plan"])
    assert {key[1] for key in placed} == {1} and len(placed) == len(set(placed)), \
        "a document was dealt twice"


def test_every_bucket_of_a_phase_dry(tmp_path):
    # a phase whose only bucket runs dry, with exhaustion allowed: a BucketExhausted stop, not an
    # error
    data = tiny_buckets(tmp_path)
    only_tiny = [{"tokens": 100_000, "mix": {"tiny": 1}}]
    loader = MIX(4, 99, "train", only_tiny, device="cpu", data_dir=data, bos_token=BOS,
                 buffer_size=4, chunk_size=8, batch_size=4, allow_bucket_exhaustion=True)
    states = []
    with pytest.raises(BucketExhausted,
                       match="every bucket of the current phase ran dry on this rank") as stop:
        for _ in range(1000):
            states.append(next(loader)[2])
    assert stop.value.state == states[-1] and stop.value.bucket is None


def test_phases_shorter_than_a_step(buckets, caplog):
    # a step is 4 * 63 = 252 tokens; the 50-token phase cannot get a batch of its own: skipped, with
    # a warning
    cur = [{"tokens": 400, "mix": {"web": 1}}, {"tokens": 50, "mix": {"code": 1}},
           {"tokens": 1000, "mix": {"math": 1}}]
    loader = MIX(4, 63, "train", cur, data_dir=buckets, allow_budget_mismatch=True, **KW)
    states = [next(loader)[2] for _ in range(6)]
    assert [s["phase"] for s in states] == [1, 1, 3, 3, 3, 3]
    assert [s["phase_tokens_done"] for s in states] == [252, 504, 252, 504, 756, 1008]
    assert ("curriculum phases [2] are shorter than one step (252 tokens) and were skipped"
            in caplog.text)


def test_validate_counts_rank_shares_and_a_longer_run(tmp_path):
    data = tiny_buckets(tmp_path)
    # tiny is one shard of 40 documents: with chunks of 32, rank 0 reads 32 of them, rank 1 only 8
    cur = [{"tokens": 20_000, "mix": {"web": 0.8, "tiny": 0.2}}]
    rows, problems, _ = validate(cur, data)
    assert not problems  # 4,000 of 8,000 tokens, one rank
    rows, problems, _ = validate(cur, data, world_size=2, chunk_size=32)
    assert [r["smallest_rank_share"] for r in rows if r["bucket"] == "tiny"] == [1_600]
    # 3,200 of 4,000 demanded are there (2 ranks x 1,600): dry 80% of the way through
    assert problems == ["phase 1: bucket 'tiny' runs dry after about 16,000 tokens of the job's "
                        "20,000: 4,000 tokens demanded by the end of the phase, 8,000 available, "
                        "the smallest of 2 ranks' shares is 1,600; fixes: give the bucket a lower "
                        "weight or more data"]
    with pytest.raises(ValueError, match="the smallest of 2 ranks' shares is 1,600"):
        MIX(4, 99, "train", cur, device="cpu", data_dir=data, bos_token=BOS, rank=0, world_size=2,
            chunk_size=32)
    # a longer run than the curriculum, accepted: the last phase goes on, and its demand counts
    rows, problems, notes = validate(cur, data, total_tokens=60_000, allow_budget_mismatch=True)
    assert (notes[0].startswith("budget mismatch")
            and "runs dry after about 40,000 tokens of the job's 60,000: 12,000 tokens demanded"
            in problems[0])
    # within one step of the curriculum's total is no mismatch (budgets are rarely whole steps)
    assert validate(cur, data, total_tokens=20_100, step_tokens=4 * 99)[1] == []
    assert validate(cur, data, total_tokens=20_500,
                    step_tokens=4 * 99)[1][0].startswith("budget mismatch")


def lengths_bucket(root, files: dict[str, list[int]]) -> list[str]:
    """A bucket "code" of one .bin/.idx pair per file, with entries of the given lengths."""
    directory = os.path.join(root, "train", "code")
    os.makedirs(directory, exist_ok=True)
    for name, lengths in files.items():
        entries = [np.full(n, BOS, dtype=np.uint16) for n in lengths]
        write_token_shard(os.path.join(directory, name), entries, [0] * len(lengths), np.uint16)
    return [os.path.join(directory, name + ".bin") for name in files]


# T=9: a row holds 10 tokens, so under "crop" an entry counts min(length, 10):
#   a: 3 25 10 11 40 -> 3 10 10 10 10;  b: 12 2 30 -> 10 2 10  (133 tokens, 65 usable)
# chunks of 2 entries, dealt to 2 ranks: rank 0 reads a[0:2] a[4:5] b[0:2], rank 1 a[2:4] b[2:3]
#   rank 0: 3+25 + 40 + 12+2 = 82 tokens, 3+10 + 10 + 10+2 = 35 usable
#   rank 1: 10+11 + 30 = 51 tokens, 10+10 + 10 = 30 usable
LENGTHS = {"a": [3, 25, 10, 11, 40], "b": [12, 2, 30]}
CODE_DRY = ("phase 1: bucket 'code' runs dry at about step 4 of 5: 100 tokens demanded by the end "
            "of the phase, 133 available, the smallest of 2 ranks' shares is 51; rows can take "
            "about 65 (the smallest rank's 30) of them: an estimated crop share of 0.51 "
            "(long_doc_policy='crop', T=9); fixes: long_doc_policy=\"split\" (long documents in "
            "pieces, not cropped); or pretokenize the bucket in windows (--max-length 10); or give "
            "the bucket a lower weight or more data")


def test_the_crop_estimate_by_hand(tmp_path):
    paths = lengths_bucket(tmp_path, LENGTHS)
    assert rank_shares(paths, 2, 2) == [82, 51]
    assert bucket_shares(paths, 2, 2, None, 9, "crop") == ([82, 51], [35, 30])
    assert bucket_shares(paths, 2, 2, None, 9, "split") == ([82, 51], [82, 51])  # nothing cropped
    assert bucket_shares(paths, 2, 1, None, 9, "crop") == ([133], [65])
    assert bucket_shares(paths, 2, 1, None, None, "crop") == ([133], [133])  # no T: no estimate
    # 90 tokens trained at T=9 demand 100 row tokens: 50 a rank. Enough tokens (51 on the smaller
    # rank), not enough usable ones (30): the job's rows can take 2 x 30 = 60, which 54 trained
    # tokens use up; a step is B=1 x T=9 x 2 ranks = 18 tokens, so step 4 (tokens 54-72) of 5
    cur = [{"tokens": 90, "mix": {"code": 1}}]
    rows, problems, notes = validate(cur, str(tmp_path), T=9, world_size=2, chunk_size=2,
                                     step_tokens=18)
    assert rows == [{"phase": 1, "bucket": "code", "weight": 1.0, "demanded": 100,
                     "demanded_so_far": 100, "available": 133, "smallest_rank_share": 51,
                     "usable": 65, "smallest_rank_usable": 30, "crop_share": 68 / 133,
                     "status": "CROP"}]
    assert notes == [CODE_DRY] and problems == []
    # strict: a problem; allow_bucket_exhaustion wins over it
    assert validate(cur, str(tmp_path), T=9, world_size=2, chunk_size=2, step_tokens=18,
                    strict=True)[1:] == ([CODE_DRY], [])
    assert validate(cur, str(tmp_path), T=9, world_size=2, chunk_size=2, step_tokens=18,
                    strict=True, allow_bucket_exhaustion=True)[1:] == ([], [CODE_DRY])
    with pytest.raises(ValueError, match="long_doc_policy must be one of"):
        validate(cur, str(tmp_path), T=9, long_doc_policy="cut")


def test_validate_prints_the_crop_estimate_and_strict_exits_1(tmp_path, capsys):
    lengths_bucket(tmp_path / "data", LENGTHS)
    config = tmp_path / "cur.yaml"
    config.write_text("curriculum:\n  - tokens: 90\n    mix: {code: 1}\n")
    args = ["validate", str(config), "--data", str(tmp_path / "data"), "--T", "9", "--B", "1",
            "--world-size", "2", "--chunk-size", "2"]
    assert mixture_main(args) == 0  # a warning
    out = capsys.readouterr().out
    assert [line.split() for line in out.splitlines() if line.strip().startswith("1 ")] == [
        ["1", "code", "1.000", "100", "100", "133", "51", "65", "0.51", "CROP"]]
    assert f"warning: {CODE_DRY}" in out and "blocking problems: none" in out
    assert mixture_main(args + ["--strict"]) == 1
    out = capsys.readouterr().out
    assert f"error: {CODE_DRY}" in out and "blocking problems: 1" in out
    # split crops nothing: all 133 tokens count, the demand fits
    assert mixture_main(args + ["--strict", "--long-doc-policy", "split"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[-3:] for line in out.splitlines() if line.strip().startswith("1 ")] == [
        ["133", "0.00", "ok"]] and "runs dry" not in out
    # without --T nothing is estimated, and the report says so
    assert mixture_main(args[:4]) == 0
    assert "crop not estimated: give --T" in capsys.readouterr().out

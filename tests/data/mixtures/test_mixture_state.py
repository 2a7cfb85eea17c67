"""
The mixture state's checksum (nanochat/data/mixtures/mixture_state.py): a state whose field was
edited by hand, its checksum left as it was, is refused with an error naming the checksum, both
when a loader resumes from it and when merge_mixture_states is given it; allow_state_mismatch=True
is the only way past it. Small buckets of known tokens under tmp_path. Run:
    python -m pytest tests/data/mixtures/test_mixture_state.py -q
"""

import pytest

from conftest import token_bucket
from nanochat.data.mixtures.mixture_state import merge_mixture_states
from nanochat.mixture import pretokenized_mixture_loader_with_state_bos_bestfit as MIX

BOS = 1
CURRICULUM = [{"tokens": 50_000, "mix": {"web": 0.5, "code": 0.5}}]
KW = dict(device="cpu", buffer_size=16, chunk_size=32, batch_size=16, bos_token=BOS,
          vocab_size=3000)
B, T = 2, 31


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Two buckets of 3,000 documents of 2 to 40 tokens each: far more than the curriculum needs."""
    root = tmp_path_factory.mktemp("mixture_state")
    token_bucket(root, "web", 1000)
    token_bucket(root, "code", 2000)
    return str(root)


def states_after(data_dir, steps: int, world_size: int = 1) -> list[dict]:
    """Each rank's state after `steps` batches."""
    states = []
    for rank in range(world_size):
        loader = MIX(B, T, "train", CURRICULUM, data_dir=data_dir, rank=rank,
                     world_size=world_size, **KW)
        for _ in range(steps):
            _, _, state = next(loader)
        states.append(state)
    return states


# (a field, and an edit that keeps every field valid: only the checksum can tell)
EDITS = {
    "position": lambda s: s.__setitem__("position", s["position"] + 1),
    "tokens_done": lambda s: s.__setitem__("tokens_done", s["tokens_done"] + B * T),
    "emitted batches": lambda s: s["emitted"].__setitem__("batches", s["emitted"]["batches"] + 1),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_state_is_refused_by_a_resuming_loader(data_dir, edit):
    state, = states_after(data_dir, 3)
    assert next(MIX(B, T, "train", CURRICULUM, data_dir=data_dir, resume_state_dict=state,
                    **KW))  # the state as written resumes
    EDITS[edit](state)  # the checksum is left as it was
    with pytest.raises(ValueError, match=r"^resume_state_dict\['checksum'\] does not match its "
                                         r"contents: the state was edited or corrupted; pass "
                                         r"allow_state_mismatch=True to resume from it anyway$"):
        MIX(B, T, "train", CURRICULUM, data_dir=data_dir, resume_state_dict=state, **KW)
    # the one way past it, said in the message
    assert next(MIX(B, T, "train", CURRICULUM, data_dir=data_dir, resume_state_dict=state,
                    allow_state_mismatch=True, **KW))


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_state_is_refused_by_the_merge(data_dir, edit):
    states = states_after(data_dir, 3, world_size=2)
    merged = merge_mixture_states(states, 3, data_dir=data_dir)  # as written: merged
    assert len(merged["states"]) == 3
    EDITS[edit](states[1])  # the checksum is left as it was
    with pytest.raises(ValueError, match=r"^states\[1\]\['checksum'\] does not match its contents "
                                         r"\(edited or corrupted\)$"):
        merge_mixture_states(states, 3, data_dir=data_dir)


def test_an_edited_state_of_a_merge_is_refused_by_a_resuming_loader(data_dir):
    merged = merge_mixture_states(states_after(data_dir, 3, world_size=2), 3, data_dir=data_dir)
    merged["states"][2]["position"] += 1  # the checksum is left as it was
    with pytest.raises(ValueError, match=r"^resume_state_dict\['states'\]\[2\]\['checksum'\] does "
                                         r"not match its contents: the state was edited"):
        MIX(B, T, "train", CURRICULUM, data_dir=data_dir, rank=2, world_size=3,
            resume_state_dict=merged, **KW)

"""
The contract with nanochat's own scripts (karpathy/nanochat 92d63d4), pinned without their code:
our modules driven exactly as tok_train, base_train, base_eval, chat_sft/chat_rl and the engine
call them, with the names, argument forms and return types they use, and the files they write and
read (token_bytes.pt, tokenizer.pkl, a checkpoint's meta JSON holding the loader state). Only
NANOCHAT_BASE_DIR is set, and the shards lie where nanochat's downloader puts them.

    python -m pytest tests/test_nanochat_contract.py -q
"""

import json
import os
import pickle
import random

import pytest
import tiktoken
import torch

from conftest import write_shard
from nanochat.common import get_base_dir
from nanochat.dataloader import (tokenizing_distributed_data_loader_bos_bestfit,
                                 tokenizing_distributed_data_loader_with_state_bos_bestfit)
from nanochat.dataset import parquets_iter_batched
from nanochat.tokenizer import SPECIAL_TOKENS, RustBPETokenizer, get_token_bytes, get_tokenizer

SYLLABLES = "ta ke ro mi su na lo pe di gu an ev or is ut sh th ch qu".split()
WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at "
         "which").split()


def _prose(i: int) -> str:
    """A seeded English-like sentence: common words and made-up ones (enough pairs for a few
    hundred merges)."""
    rng = random.Random(i)
    words = [rng.choice(WORDS) if rng.random() < 0.5
             else "".join(rng.choices(SYLLABLES, k=rng.randint(1, 4)))
             for _ in range(rng.randint(5, 90))]
    return " ".join(words).capitalize() + "."


@pytest.fixture
def downloaded():
    """ClimbMix as nanochat's downloader lays it out: base_data_climbmix/shard_00000..2 +
    shard_06542."""
    data_dir = os.path.join(get_base_dir(), "base_data_climbmix")
    os.makedirs(data_dir)
    for f, index in enumerate((0, 1, 2, 6542)):
        docs = [_prose(f * 1000 + i) for i in range(120)]
        write_shard(os.path.join(data_dir, f"shard_{index:05d}.parquet"), docs, row_group_size=16)
    return data_dir


def _tok_train_as_nanochat_does(vocab_size: int) -> RustBPETokenizer:
    """What scripts/tok_train.py does, step by step, with its argument forms."""
    def text_iterator():
        for batch in parquets_iter_batched(split="train"):  # keyword split, no data_dir
            assert isinstance(batch, list) and all(isinstance(doc, str) for doc in batch)
            yield from (doc[:10_000] for doc in batch)
    tokenizer = RustBPETokenizer.train_from_iterator(text_iterator(), vocab_size)
    tokenizer_dir = os.path.join(get_base_dir(), "tokenizer")
    tokenizer.save(tokenizer_dir)
    text = "Hello world! Numbers: 123, 4567\nUnicode: 你好世界 🌍"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    special_ids = set(tokenizer.encode_special(s) for s in tokenizer.get_special_tokens())
    token_bytes = [0 if i in special_ids else len(tokenizer.decode_single_token_bytes(i))
                   for i in range(tokenizer.get_vocab_size())]
    with open(os.path.join(tokenizer_dir, "token_bytes.pt"), "wb") as f:
        torch.save(torch.tensor(token_bytes, dtype=torch.int32, device="cpu"), f)
    return tokenizer


def test_tok_train_then_base_train_calls(downloaded):
    trained = _tok_train_as_nanochat_does(vocab_size=600)
    # base_train / base_eval / checkpoint_manager
    tokenizer = get_tokenizer()
    token_bytes = get_token_bytes(device="cpu")
    assert tokenizer.get_vocab_size() == trained.get_vocab_size() == 600
    assert token_bytes.dtype == torch.int32 and token_bytes.shape == (600,)
    # what tok_train wrote (token_bytes.pt) is what get_token_bytes gives (from the token_bytes.npy
    # of save())
    written = torch.load(os.path.join(get_base_dir(), "tokenizer", "token_bytes.pt"),
                         weights_only=True)
    assert token_bytes.tolist() == written.tolist() == trained.compute_token_bytes().tolist()
    # the raw bytes >= 0x80: one byte each, not U+FFFD's three
    assert written[128:256].tolist() == [1] * 128
    # and from the .pt alone
    os.remove(os.path.join(get_base_dir(), "tokenizer", "token_bytes.npy"))
    assert get_token_bytes(device="cpu").tolist() == written.tolist()
    assert ([int(token_bytes[tokenizer.encode_special(s)]) for s in SPECIAL_TOKENS]
            == [0] * len(SPECIAL_TOKENS))
    B, T = 4, 32
    train_loader = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tokenizer, B, T, split="train", device="cpu", resume_state_dict=None)
    x, y, state = next(train_loader)  # "kick off load of the very first batch"
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
    assert (x[:, 0] == tokenizer.get_bos_token_id()).all()
    assert torch.equal(x[:, 1:], y[:, :-1])
    # the training loop logs these three keys of the state
    assert all(isinstance(state[k], int) for k in ("epoch", "pq_idx", "rg_idx"))
    # base_eval passes the split positionally
    val_loader = tokenizing_distributed_data_loader_bos_bestfit(tokenizer, B, T, "val",
                                                                device="cpu")
    vx, vy = next(val_loader)
    assert vx.shape == (B, T) and torch.equal(vx[:, 1:], vy[:, :-1])
    # loss_eval indexes token_bytes with the targets
    assert token_bytes[vy].shape == (B, T)
    # the engine and the evaluations
    assert tokenizer("hi there", prepend="<|bos|>")[0] == tokenizer.get_bos_token_id()
    batch = tokenizer(["a b", "c"], prepend=tokenizer.get_bos_token_id())
    assert [ids[0] for ids in batch] == [tokenizer.get_bos_token_id()] * 2
    assert tokenizer.decode(tokenizer.encode("the of and")) == "the of and"
    # chat_sft renders conversations with masks, chat_rl primes a completion
    conversation = {"messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "the end"}]}
    ids, mask = tokenizer.render_conversation(conversation)
    assert isinstance(ids, list) and isinstance(mask, list) and len(ids) == len(mask)
    assert [i for i, m in zip(ids, mask) if m] == (
        tokenizer.encode("the end") + [tokenizer.encode_special("<|assistant_end|>")])
    prompt = tokenizer.render_for_completion(conversation)
    assert prompt == ids[:ids.index(tokenizer.encode_special("<|assistant_start|>")) + 1]


def test_checkpoint_meta_json_resumes_the_same_batches(downloaded):
    """base_train saves the state in the checkpoint's meta JSON and passes it back on
    --resume-from-step."""
    tokenizer = _tok_train_as_nanochat_does(vocab_size=400)
    B, T = 2, 24
    run = tokenizing_distributed_data_loader_with_state_bos_bestfit(tokenizer, B, T, split="train",
                                                                    device="cpu")
    batches = [(x.clone(), y.clone(), state) for x, y, state in (next(run) for _ in range(12))]
    meta_path = os.path.join(get_base_dir(), "meta_000005.json")
    with open(meta_path, "w") as f:
        json.dump({"step": 5, "dataloader_state_dict": batches[5][2]}, f, indent=2)
    with open(meta_path) as f:
        resume = json.load(f)["dataloader_state_dict"]
    resumed = tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tokenizer, B, T, split="train", device="cpu", resume_state_dict=resume)
    for x, y, state in batches[6:]:
        rx, ry, rstate = next(resumed)
        assert torch.equal(rx, x) and torch.equal(ry, y) and rstate == state


def test_a_tokenizer_trained_by_nanochat_loads_from_its_pickle(downloaded):
    """A directory nanochat's own tok_train wrote: tokenizer.pkl (a pickled tiktoken Encoding) and
    token_bytes.pt."""
    ours = _tok_train_as_nanochat_does(vocab_size=500)
    tokenizer_dir = os.path.join(get_base_dir(), "tokenizer")
    enc = tiktoken.Encoding("rustbpe", pat_str=ours.enc._pat_str,
                            mergeable_ranks=ours.enc._mergeable_ranks,
                            special_tokens=ours.enc._special_tokens)
    for name in ("tokenizer.json", "token_bytes.npy"):
        os.remove(os.path.join(tokenizer_dir, name))
    with open(os.path.join(tokenizer_dir, "tokenizer.pkl"), "wb") as f:
        pickle.dump(enc, f)
    tokenizer = get_tokenizer()
    texts = [_prose(i) for i in range(50)] + ["<|bos|> is plain text here", "naïve café 你好"]
    assert tokenizer.encode(texts, prepend="<|bos|>") == ours.encode(texts, prepend="<|bos|>")
    assert tokenizer.get_special_tokens() == set(SPECIAL_TOKENS)
    assert get_token_bytes(device="cpu").tolist() == ours.compute_token_bytes().tolist()
    x, y, _ = next(tokenizing_distributed_data_loader_with_state_bos_bestfit(tokenizer, 2, 16,
                                                                             "train", device="cpu"))
    assert x.shape == (2, 16)


@pytest.mark.parametrize("layout, subdir, val",
                         [("climbmix", "base_data_climbmix", "shard_06542.parquet"),
                          ("fineweb", "base_data", "shard_01822.parquet"),
                          ("own", "base_data_climbmix", "shard_00008.parquet")])
def test_the_dropin_check_lays_out_what_the_downloader_would(layout, subdir, val, tmp_path,
                                                             monkeypatch):
    # scripts/nanochat_dropin.py runs nanochat's scripts on these layouts (it needs a nanochat
    # checkout)
    from nanochat.data.base.datasets import split_parquet_files
    from scripts.nanochat_dropin import main, write_layout
    write_layout(str(tmp_path), layout)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    assert os.listdir(tmp_path) == [subdir]
    assert [os.path.basename(p) for p in split_parquet_files("val")] == [val]
    assert len(split_parquet_files("train")) == 8
    with pytest.raises(SystemExit):  # not a nanochat checkout
        main([str(tmp_path), "--out", str(tmp_path / "out")])

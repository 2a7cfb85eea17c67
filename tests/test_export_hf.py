"""
Tests for exporting our tokenizer as a Hugging Face tokenizer.json (RustBPETokenizer.to_hf_json,
export_hf and `python -m nanochat.tokenizer export-hf`).

The export is loaded with the `tokenizers` library (an optional dependency, in the test extras;
those tests skip without it) and must encode every text token for token as ours does, special
tokens included, and decode any ids as ours does. The tables and the refusals (never replace a
tokenizer of ours, nor files that an earlier export did not write) are checked without it.
Tokenizers are trained in-process on generated text.
Run: python -m pytest tests/test_export_hf.py -q   (a few seconds)
"""

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from conftest import REPO_ROOT
from nanochat.tokenizer import HF_EXPORT_MARK, SPECIAL_TOKENS, RustBPETokenizer
from test_tokenizer import TEXTS, make_docs


# beside test_tokenizer's TEXTS: what our split pattern treats specially, and bytes no training
# text had
CORNER_TEXTS = [
    # numbers go in groups of at most 2 digits
    "1 12 123 1234 12345 1234567890 0.5 -42 +3e10 ٣٤٥ ５６",
    # whitespace runs, the last space stays before a word
    "   \n\n\n  \t\t x  \r\n\r\n   y\n \n",
    "trailing spaces   ", "\n", " ", "\t\t", "\r", "\r\n\r\n",
    # the contractions, in both cases
    "it's I'LL we've THEY'RE you'd she'S don't 'tis ''",
    "!!! ... ,,, ?! (a) [b] {c} <d> @#$%^&*_=+~` \\ / | ;: \"quoted\"",
    "naïve façade Ångström Øre ß İstanbul ǅ ﬁ ﬂ",
    "中文分词测试，日本語のテキスト、한국어 텍스트。",
    "🙂🙃🤖 👩🏽‍💻 🏳️‍🌈 🇯🇵🇺🇸 ✌️",
    # controls, odd spaces
    "\x00\x01\x07\x1b[31mred\x1b[0m\x7f \u0085\u00a0\u1680\u2000\u2028\u2029\u202f\u205f\u3000",
    # a BOM, the replacement char, plane 1 and 16
    "\ufeff\ufffd\uffff \U0001d54f\U0001f600 \U0010fffd",
    # combining marks, Devanagari, joiners
    "a\u0301e\u0308 \u0915\u094d\u0937 \u05e9\u05c1 \u200d\u200c",
]
SPECIAL_TEXTS = [
    "<|bos|>",
    "<|bos|>hello world<|bos|>",
    "<|user_start|>What is 2+2?<|user_end|><|assistant_start|>4<|assistant_end|>",
    "text<|python_start|>print(1)<|python_end|><|output_start|>1<|output_end|>more",
    " <|bos|> spaced <|bos|>\n",
    "<|bos <|bos|| |bos|> <|BOS|>",  # near misses stay text
]


@pytest.fixture(scope="module")
def tok():
    return RustBPETokenizer.train_from_iterator(
        iter(make_docs(3000, seed=0) + TEXTS + CORNER_TEXTS), 512)


@pytest.fixture(scope="module")
def hf_lib():
    return pytest.importorskip("tokenizers", reason="the export is loaded with the optional "
                                                    "`tokenizers` library: pip install -e '.[hf]'")


@pytest.fixture(scope="module")
def hf_tokenizer(tok, hf_lib):
    return hf_lib.Tokenizer.from_str(json.dumps(tok.to_hf_json(), ensure_ascii=False))


def ours_with_specials(tok, text: str) -> list[int]:
    """What the Hugging Face file should give: our encoding, special-token text becoming the
    special token."""
    return tok.enc.encode(text, allowed_special="all")


# -----------------------------------------------------------------------------
# The export encodes and decodes as ours


def test_encodes_as_ours(tok, hf_tokenizer):
    texts = TEXTS + CORNER_TEXTS + make_docs(300, seed=11)
    merged = 0
    for text in texts:
        ids = tok.encode(text)
        if "<|" not in text:
            assert hf_tokenizer.encode(text).ids == ids, text
        assert hf_tokenizer.encode(text).ids == ours_with_specials(tok, text), text
        merged += len(text.encode("utf-8")) - len(ids)
    assert merged > 10_000  # guard: the texts were mostly multi-byte tokens, not bytes one by one


def test_special_tokens_become_their_ids(tok, hf_tokenizer):
    for text in SPECIAL_TEXTS:
        assert hf_tokenizer.encode(text).ids == ours_with_specials(tok, text), text
    bos = tok.get_bos_token_id()
    assert (hf_tokenizer.encode("<|bos|>hello world<|bos|>").ids
            == [bos] + tok.encode("hello world") + [bos])
    # no special in it
    assert hf_tokenizer.encode("<|bos <|BOS|>").ids == tok.encode("<|bos <|BOS|>")
    for name in SPECIAL_TOKENS:
        assert hf_tokenizer.token_to_id(name) == tok.encode_special(name)
        assert hf_tokenizer.encode(name).ids == [tok.encode_special(name)]
    assert hf_tokenizer.get_vocab_size() == tok.get_vocab_size()


def test_decodes_as_ours(tok, hf_tokenizer):
    for text in TEXTS + CORNER_TEXTS + SPECIAL_TEXTS:
        ids = ours_with_specials(tok, text)
        assert hf_tokenizer.decode(ids, skip_special_tokens=False) == tok.decode(ids) == text
    # any ids, also those cutting a character (both decode the broken bytes to U+FFFD)
    rng = random.Random(0)
    for _ in range(2000):
        ids = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randint(1, 12))]
        assert hf_tokenizer.decode(ids, skip_special_tokens=False) == tok.decode(ids), ids


# any text, and text of the characters our pattern treats specially, packed close together
TRICKY = list("aZé好 \t\n\r'sSlLvVeEdDmMtT0123456789.,!?-_<|>\u00a0\u2028\u3000") + [
    "🙂", "\u0301", "<|bos|>"]


@settings(max_examples=300, deadline=None)
@given(text=st.text() | st.lists(st.sampled_from(TRICKY), max_size=40).map("".join))
def test_encodes_as_ours_any_text(tok, hf_tokenizer, text):
    ids = hf_tokenizer.encode(text).ids
    assert ids == ours_with_specials(tok, text)
    assert hf_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tokens_built_several_ways(hf_lib):
    # on a two-letter alphabet most tokens can be split into two tokens in several ways, and which
    # pair merges first decides the encoding: a merge list in another order fails almost every
    # string here
    rng = random.Random(1)
    docs = ["".join(rng.choice("ab") for _ in range(rng.randint(5, 200))) for _ in range(2000)]
    small = RustBPETokenizer.train_from_iterator(iter(docs), 400)
    data = small.to_hf_json()
    multi_byte = [t for t in small.mergeable_ranks if len(t) > 1]
    # guard: many tokens have several splits
    assert len(data["model"]["merges"]) > 2 * len(multi_byte)
    hf_small = hf_lib.Tokenizer.from_str(json.dumps(data))
    for _ in range(500):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 300)))
        assert hf_small.encode(text).ids == small.encode(text), text


# -----------------------------------------------------------------------------
# The tables


def test_hf_json_tables(tok):
    data = tok.to_hf_json()
    model = data["model"]
    assert (model["type"], model["byte_fallback"], model["ignore_merges"]) == ("BPE", False, True)
    assert data["pre_tokenizer"]["pretokenizers"][0]["pattern"] == {"Regex": tok.pattern}
    assert data["pre_tokenizer"]["pretokenizers"][1]["use_regex"] is False
    # byte-level characters: printable Latin-1 stands for itself, the rest from U+0100 on (space is
    # 'Ġ')
    char_to_byte = {}
    for token, rank in tok.mergeable_ranks.items():
        if len(token) == 1:
            (char,) = [c for c, r in model["vocab"].items() if r == rank]
            char_to_byte[char] = token[0]
    assert len(char_to_byte) == 256
    assert char_to_byte["a"] == ord("a") and char_to_byte["ÿ"] == 0xFF
    assert (char_to_byte["\u0100"] == 0x00 and char_to_byte["Ġ"] == 0x20
            and char_to_byte["Ċ"] == 0x0A)
    assert char_to_byte["\u0143"] == 0xAD  # the soft hyphen, the last of the 68 moved bytes

    def to_bytes(chars: str) -> bytes:
        return bytes(char_to_byte[c] for c in chars)

    # the vocab is our mergeable tokens with their ranks as ids
    assert {to_bytes(chars): rank for chars, rank in model["vocab"].items()} == tok.mergeable_ranks
    # each merge makes a token; tokens in rank order; and every split of a token into two tokens is
    # there
    merges = [tuple(to_bytes(part) for part in merge.split(" ")) for merge in model["merges"]]
    made = [tok.mergeable_ranks[left + right] for left, right in merges]
    assert made == sorted(made)
    assert len(set(merges)) == len(merges)
    every_split = {(t[:i], t[i:]) for t in tok.mergeable_ranks for i in range(1, len(t))
                   if t[:i] in tok.mergeable_ranks and t[i:] in tok.mergeable_ranks}
    assert set(merges) == every_split
    # specials: added, special, matched as written, with our ids
    assert [(t["content"], t["id"], t["special"], t["normalized"])
            for t in data["added_tokens"]] == [
        (name, tok.encode_special(name), True, False) for name in SPECIAL_TOKENS]


# -----------------------------------------------------------------------------
# Writing: the CLI, and what it never replaces


def export_cli(out_dir, tokenizer_dir=None, base_dir=None) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "nanochat.tokenizer", "export-hf", str(out_dir)]
    if tokenizer_dir is not None:
        args += ["--tokenizer-dir", str(tokenizer_dir)]
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base_dir)) if base_dir else None
    return subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


def read_files(directory) -> dict[str, bytes]:
    return {name: open(os.path.join(directory, name), "rb").read()
            for name in sorted(os.listdir(directory))}


def test_cli_writes_the_export(tok, tmp_path):
    base = tmp_path / "base"
    tok.save(str(base / "tokenizer"))  # the default SRC: <base_dir>/tokenizer
    out = tmp_path / "hf"
    result = export_cli(out, base_dir=base)
    assert result.returncode == 0, result.stderr
    assert f"wrote {out / 'tokenizer.json'}" in result.stdout and "vocab size 512" in result.stdout
    files = read_files(out)
    assert sorted(files) == ["tokenizer.json", "tokenizer_config.json"]  # no temp files left
    assert json.loads(files["tokenizer.json"]) == tok.to_hf_json()
    config = json.loads(files["tokenizer_config.json"])
    assert (config["bos_token"] == "<|bos|>"
            and config["tokenizer_class"] == "PreTrainedTokenizerFast")
    assert HF_EXPORT_MARK in config

    # an earlier export is replaced by the new one, of another tokenizer
    other = RustBPETokenizer.train_from_iterator(iter(make_docs(500, seed=4)), 300)
    other.save(str(tmp_path / "other"))
    result = export_cli(out, tokenizer_dir=tmp_path / "other")
    assert result.returncode == 0, result.stderr
    assert json.loads(read_files(out)["tokenizer.json"]) == other.to_hf_json()


def test_cli_loads_in_tokenizers(tok, hf_lib, tmp_path):
    tok.save(str(tmp_path / "src"))
    assert export_cli(tmp_path / "hf", tmp_path / "src").returncode == 0
    loaded = hf_lib.Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    for text in TEXTS + SPECIAL_TEXTS:
        assert loaded.encode(text).ids == ours_with_specials(tok, text)


def test_our_loader_names_an_export_for_what_it_is(tok, tmp_path):
    tok.export_hf(tmp_path / "hf")
    with pytest.raises(FileNotFoundError, match="is a Hugging Face tokenizer.json .export-hf "
                                                "writes these.*directory it was exported from"):
        RustBPETokenizer.from_directory(str(tmp_path / "hf"))


def test_cli_refuses_the_tokenizer_dir_itself(tok, tmp_path):
    src = tmp_path / "src"
    tok.save(str(src))
    before = read_files(src)
    result = export_cli(src, tokenizer_dir=src)
    assert result.returncode == 1
    assert (f"DIR {src} is the tokenizer's own directory" in result.stderr
            and "another directory" in result.stderr)
    assert read_files(src) == before
    # the same directory by another name
    result = export_cli(str(src) + "/../src", tokenizer_dir=src)
    assert result.returncode == 1 and "own directory" in result.stderr
    assert read_files(src) == before


def foreign_hf_json(tok) -> bytes:
    """A Hugging Face tokenizer.json that export-hf did not write (say a model's, copied there by
    the user)."""
    data = tok.to_hf_json()
    data["added_tokens"] = []
    return json.dumps(data).encode()


@pytest.mark.parametrize("present, refused, message", [
    ({"tokenizer.json": "ours"}, "tokenizer.json", "is a nanochat tokenizer (our own format)"),
    ({"tokenizer.json": "ours", "tokenizer_config.json": "export"}, "tokenizer.json",
     "our own format"),
    ({"tokenizer.pkl": b"\x80\x04."}, "", "holds nanochat's tokenizer.pkl"),
    ({"tokenizer.json": "foreign"}, "tokenizer.json", "was not written by export-hf"),
    ({"tokenizer.json": "foreign", "tokenizer_config.json": b'{"bos_token": "<s>"}'},
     "tokenizer.json", "was not written by export-hf"),
    ({"tokenizer.json": b"not json"}, "tokenizer.json", "was not written by export-hf"),
    ({"tokenizer_config.json": b'{"tokenizer_class": "LlamaTokenizer"}'}, "tokenizer_config.json",
     "has no 'nanochat_export'"),
    ({"tokenizer_config.json": b"[1, 2]"}, "tokenizer_config.json", "has no 'nanochat_export'"),
])
def test_refuses_to_replace(tok, tmp_path, present, refused, message):
    out = tmp_path / "out"
    tok.save(str(tmp_path / "ours"))
    export_config = tmp_path / "export"
    tok.export_hf(str(export_config))
    contents = {"ours": open(tmp_path / "ours" / "tokenizer.json", "rb").read(),
                "foreign": foreign_hf_json(tok),
                "export": open(export_config / "tokenizer_config.json", "rb").read()}
    out.mkdir()
    for name, content in present.items():
        (out / name).write_bytes(contents.get(content, content))
    before = read_files(out)
    with pytest.raises(FileExistsError, match="never|beside it") as error:
        tok.export_hf(str(out))
    assert message in str(error.value) and str(out / refused) in str(error.value)
    assert "export into another directory" in str(error.value)
    assert read_files(out) == before  # nothing written, nothing replaced
    # the CLI says the same in one line
    result = export_cli(out, tokenizer_dir=tmp_path / "ours")
    assert (result.returncode == 1 and result.stderr.startswith("error: ")
            and message in result.stderr)
    assert read_files(out) == before


def test_export_is_atomic(tok, tmp_path, monkeypatch):
    def failing_replace(src, dst):
        raise OSError("disk full (simulated)")
    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        tok.export_hf(str(tmp_path / "fresh"))
    assert os.listdir(tmp_path / "fresh") == []  # nothing under the final names, no temp files


def test_export_accepts_home_and_paths(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    paths = tok.export_hf("~/hf")
    assert paths == [str(tmp_path / "hf" / "tokenizer_config.json"),
                     str(tmp_path / "hf" / "tokenizer.json")]
    shutil.rmtree(tmp_path / "hf")
    assert tok.export_hf(tmp_path / "hf") == paths  # a pathlib.Path

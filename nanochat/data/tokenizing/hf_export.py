"""
Our tokenizer exported for Hugging Face tools.
Our tokenizer for Hugging Face tools (`python -m nanochat.tokenizer export-hf DIR`): a
`tokenizers` tokenizer.json that encodes as tiktoken does with our tables (a byte-level BPE with
every merge that builds a token), and a tokenizer_config.json for transformers' AutoTokenizer. An
export never replaces a tokenizer of ours, nor files that an earlier export did not write.

Cost: one pass over the vocab and, for the merges, over each token's ways to split in two.

May import: nanochat.data.tokenizing.tokenizer_files.
"""

import json
import logging
import os

from nanochat.data.tokenizing.tokenizer_files import (FORMAT_NAME, PICKLE_FILENAME,
                                                       TOKENIZER_FILENAME, write_atomic)

logger = logging.getLogger(__name__)

# what transformers' AutoTokenizer reads beside tokenizer.json
HF_CONFIG_FILENAME = "tokenizer_config.json"
# a key of the tokenizer_config.json that export-hf writes: it tells an earlier export, which a new
# one may replace, from files someone else put there (tokenizer.json itself admits no key of ours)
HF_EXPORT_MARK = "nanochat_export"


def export_hf(tokenizer, out_dir: str | os.PathLike) -> list[str]:
    """Write a RustBPETokenizer for Hugging Face tools into out_dir (created if needed):
    tokenizer.json (hf_json) and a tokenizer_config.json that makes transformers'
    AutoTokenizer load it with our BOS as bos_token. Returns the paths written. Refuses
    (FileExistsError) to replace a tokenizer of ours (tokenizer.json in our format,
    tokenizer.pkl) or files that an earlier export did not write."""
    out_dir = os.path.expanduser(os.fspath(out_dir))
    check_export_dir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        # transformers would otherwise (4.x) drop the space before punctuation when decoding
        "clean_up_tokenization_spaces": False,
        HF_EXPORT_MARK: "python -m nanochat.tokenizer export-hf",
    }
    tokenizer_json = json.dumps(
        hf_json(tokenizer.pattern, tokenizer.mergeable_ranks, tokenizer.special_tokens),
        ensure_ascii=False, indent=2).encode("utf-8")
    # the config first: a tokenizer.json in out_dir always has the mark beside it, so a new
    # export may replace it
    paths = [os.path.join(out_dir, HF_CONFIG_FILENAME),
             os.path.join(out_dir, TOKENIZER_FILENAME)]
    config_bytes = json.dumps(config, indent=2).encode("utf-8") + b"\n"
    write_atomic(paths[0], lambda f: f.write(config_bytes))
    write_atomic(paths[1], lambda f: f.write(tokenizer_json))
    logger.info("exported the tokenizer (vocab size %d) for Hugging Face tools to %s",
                tokenizer.get_vocab_size(), out_dir)
    return paths


def check_export_dir(out_dir: str) -> None:
    """Raise FileExistsError unless export_hf may write into out_dir: nothing of a nanochat
    tokenizer is there, and a tokenizer.json or tokenizer_config.json there came from an earlier
    export."""
    json_path = os.path.join(out_dir, TOKENIZER_FILENAME)
    config_path = os.path.join(out_dir, HF_CONFIG_FILENAME)
    pkl_path = os.path.join(out_dir, PICKLE_FILENAME)
    fix = "export into another directory (a new or empty one)"
    if os.path.exists(pkl_path):
        # a Hugging Face tokenizer.json beside it would be loaded instead of the pickle, and fail
        raise FileExistsError(f"{out_dir} holds nanochat's {PICKLE_FILENAME}; export-hf writes no "
                              f"{TOKENIZER_FILENAME} beside it: {fix}")
    config = _read_json_object(config_path) if os.path.exists(config_path) else None
    earlier_export = config is not None and HF_EXPORT_MARK in config
    if os.path.exists(json_path):
        existing = _read_json_object(json_path)
        if existing is not None and existing.get("format") == FORMAT_NAME:
            raise FileExistsError(f"{json_path} is a nanochat tokenizer (our own format); "
                                  f"export-hf never replaces it: {fix}")
        if not earlier_export or existing is None or "model" not in existing:
            raise FileExistsError(f"{json_path} exists and was not written by export-hf (no "
                                  f"{HF_CONFIG_FILENAME} with {HF_EXPORT_MARK!r} beside it); "
                                  f"export-hf never replaces it: {fix}")
    if os.path.exists(config_path) and not earlier_export:
        raise FileExistsError(f"{config_path} exists and was not written by export-hf (it has no "
                              f"{HF_EXPORT_MARK!r}); export-hf never replaces it: {fix}")


def _read_json_object(path: str) -> dict | None:
    """The JSON object in path, or None when the file is not one (not JSON, not UTF-8, not a
    dict)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def hf_json(pattern: str, mergeable_ranks: dict[bytes, int],
            special_tokens: dict[str, int]) -> dict:
    """A tokenizer's tables as a Hugging Face `tokenizers` file (the dict that its tokenizer.json
    holds): a byte-level BPE model whose vocab is our mergeable tokens with their ranks as ids,
    a pre-tokenizer that splits on our pattern, and our special tokens as added tokens with
    their ids. It encodes text as tiktoken does with allowed_special="all": like encode(), but
    special-token text becomes that token. No BOS is added (encode prepends none either)."""
    alphabet = _byte_level_alphabet()

    def chars(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    by_rank = sorted(mergeable_ranks.items(), key=lambda kv: kv[1])
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
    specials = sorted(special_tokens.items(), key=lambda kv: kv[1])
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": token_id, "content": name, "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": False,
                          "special": True}
                         for name, token_id in specials],
        "normalizer": None,
        # our regex cuts the text into pieces, then each piece's bytes become characters; the
        # ByteLevel step must not split again with GPT-2's own regex (use_regex False)
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
             "invert": False},
            byte_level,
        ]},
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            # a piece that is one token is that token, as in tiktoken (the merges might split
            # it otherwise)
            "ignore_merges": True,
            "vocab": {chars(token): rank for token, rank in by_rank},
            # "left right": a byte-level token never holds a space (the space byte is U+0120),
            # and every version of `tokenizers` reads this form
            "merges": [f"{chars(left)} {chars(right)}"
                       for left, right in _hf_merges(mergeable_ranks)],
        },
    }


def _byte_level_alphabet() -> list[str]:
    """The character that stands for each byte (the list's index) in a byte-level BPE vocab:
    GPT-2's convention, which Hugging Face's ByteLevel pre-tokenizer and decoder use. The 188
    printable Latin-1 bytes stand for themselves; the other 68 (controls, space, DEL, no-break
    space, soft hyphen) for U+0100, U+0101, ... in byte order, so the space byte is U+0120 'Ġ'."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    alphabet, shifted = [], 0
    for b in range(256):
        if b in printable:
            alphabet.append(chr(b))
        else:
            alphabet.append(chr(0x100 + shifted))
            shifted += 1
    return alphabet


def _hf_merges(mergeable_ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list of a Hugging Face BPE model that encodes as tiktoken does with these ranks.
    tiktoken merges, among adjacent parts of a piece, the pair whose concatenation has the lowest
    rank; Hugging Face merges the pair listed first. So every way to build a token from two tokens
    is listed, token by token in rank order: each pair comes where its concatenation's rank puts
    it, and every pair tiktoken could merge is there. The pairs of one token go by their parts'
    ranks. That order decides only when two adjacent pairs make the same token at once (Hugging
    Face merges the one listed first, tiktoken the left one); with trained vocabs we found no text
    where it does (tests/data/tokenizing/test_hf_export.py)."""
    merges = []
    for token, _ in sorted(mergeable_ranks.items(), key=lambda kv: kv[1]):
        pairs = [(token[:i], token[i:]) for i in range(1, len(token))
                 if token[:i] in mergeable_ranks and token[i:] in mergeable_ranks]
        pairs.sort(key=lambda pair: (mergeable_ranks[pair[0]], mergeable_ranks[pair[1]]))
        merges.extend(pairs)
    return merges

"""
pretokenize.json: the settings a run records beside its pairs, and their checks.
pretokenize.json: the settings a run records beside its pairs (the format, the tokenizer's hash,
vocabulary and BOS, the windows, the convention), and the checks that keep runs with other settings
from adding pairs to the same directory, or a bucket of another tokenizer to a mixture's output.
The loaders read it back (token_reader.shard_vocab). Format: docs/pretokenized.md.

May import: nanochat.data.base.files, nanochat.data.pretokenized.token_shards.
"""

import errno
import hashlib
import json
import os
import tempfile

from nanochat.data.base.files import remove_if_exists
from nanochat.data.pretokenized.token_shards import MAGIC, META_FILENAME, VERSION

# what os.link raises on a filesystem without hard links
NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK)
# what a mixture's buckets must share: it reads all of their ids as one vocabulary
SHARED_KEYS = ("tokenizer_sha256", "vocab_size", "bos_token_id", "dtype", "convention")


def run_settings(tokenizer, tokenizer_file: str, max_length: int | None, overlap: int,
                 convention: str = "nanochat") -> dict:
    """The settings this run records: the format, the tokenizer (tokenizer_file: the file it was
    loaded from, hashed), the windows and the convention."""
    # the file's hash, not the vocabulary size: two tokenizers of one size give other ids
    with open(tokenizer_file, "rb") as f:
        tokenizer_sha256 = hashlib.sha256(f.read()).hexdigest()
    return {
        "format": MAGIC.decode(), "version": VERSION,
        "dtype": "uint16" if tokenizer.get_vocab_size() <= 2**16 else "uint32",
        "vocab_size": tokenizer.get_vocab_size(), "bos_token_id": tokenizer.get_bos_token_id(),
        "tokenizer_sha256": tokenizer_sha256,
        "max_length": max_length, "overlap_size": overlap if max_length is not None else 0,
        # the loaders take the BOS to prepend from here: the BOS, or for gpt-simple the EOD (the
        # same id)
        "convention": convention,
        "eod_token_id": tokenizer.get_bos_token_id() if convention == "gpt-simple" else None,
    }


def check_or_write_settings(directories: list[str], settings: dict, instead: str) -> None:
    """Write pretokenize.json into each directory (the output, or a bucket's directory in each
    split), or refuse to add shards made with other settings to one of them (instead: where else to
    write them)."""
    # every directory is checked before any is written, so a refusal leaves nothing half-recorded
    for directory in directories:
        _check(os.path.join(directory, META_FILENAME), settings, instead)
    for directory in directories:
        path = os.path.join(directory, META_FILENAME)
        if os.path.exists(path):
            continue
        os.makedirs(directory, exist_ok=True)
        # a name of its own: ranks on several machines may write it at once, with one pid
        fd, tmp = tempfile.mkstemp(prefix=f".{META_FILENAME}.", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(settings, f, indent=2)
            f.write("\n")
        try:
            # atomic, and only where there is none: of two runs planning at once with other
            # settings, the second finds the first's file and is refused
            os.link(tmp, path)
        except FileExistsError:
            _check(path, settings, instead)
        except OSError as e:
            if e.errno not in NO_HARD_LINKS:
                raise
            os.replace(tmp, path)  # atomic still, but the last writer's
        finally:
            remove_if_exists(tmp)


def _check(path: str, settings: dict, instead: str) -> None:
    """Refuse settings other than those recorded at path, if any."""
    if not os.path.exists(path):
        return
    old = read_settings(path)
    changed = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
    if changed:
        what = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
        raise ValueError(f"{path} records other settings than this run's ({what}); the shards "
                         f"there would mix, so use {instead} or the same settings")


def check_other_buckets(output: str, bucket: str, settings: dict) -> None:
    """Refuse a bucket made with another tokenizer than the buckets already in output: a mixture
    reads all of its buckets' ids as one vocabulary. (Windowing may differ from bucket to
    bucket.)"""
    for split in ("train", "val"):
        split_dir = os.path.join(output, split)
        for name in sorted(os.listdir(split_dir)) if os.path.isdir(split_dir) else []:
            path = os.path.join(split_dir, name, META_FILENAME)
            if name == bucket or not os.path.isfile(path):
                continue
            old = read_settings(path)
            changed = [f"{k} {old.get(k)!r} -> {settings[k]!r}" for k in SHARED_KEYS
                       if old.get(k) != settings[k]]
            if changed:
                raise ValueError(f"{path} records another tokenizer than this run's "
                                 f"({', '.join(changed)}); the buckets of one mixture are read as "
                                 "one vocabulary, so pretokenize with the tokenizer of the others, "
                                 "or into a new --output directory")


def read_settings(path: str) -> dict:
    """The settings in the pretokenize.json at path; a file without the convention field records
    nanochat's."""
    try:
        with open(path, encoding="utf-8") as f:
            settings = json.load(f)
    except ValueError as e:  # not JSON, not UTF-8
        raise ValueError(f"{path} (pretokenize's settings) is not valid JSON: {e}; restore it, or "
                         "remove it together with the shards beside it and run again") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{path} holds a JSON {type(settings).__name__}, not pretokenize's "
                         "settings")
    return {"convention": "nanochat", **settings}  # a file without the field: nanochat's convention

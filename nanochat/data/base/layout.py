"""
What a data directory holds, told from its file names alone (no file is opened).
A loader or a command given the wrong kind of directory then says what it holds and what to pass
instead, and never suggests writing into it. The kinds:

    parquet        *.parquet shards: a dataset directory, what the parquet loader reads
    pretokenized   a pretokenize output: .bin/.idx pairs in train/ and val/
    buckets        a mixture's data: pairs in train/<bucket>/ and val/<bucket>/
    pairs          .bin/.idx pairs right in it: one split's directory of an output, or one bucket's
    empty          none of these (other files, or nothing); missing: no such directory
    file           a file, not a directory (most often a shard, passed for its directory)

Cost: a directory listing or three, only on the way to an error, or once when pretokenize starts.

May import: the standard library.
"""

import os
import re


SPLITS = ("train", "val")
LISTING = "index.json"  # <base_url>/index.json: {"files": [{"name": ..., "size": ...}, ...]}
# text files that `python -m nanochat.dataset repackage` turns into shards
INPUT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")

# part k of n of an input NAME split by pretokenize: its pair is NAME.part-0000k-of-0000n
PART_SUFFIX = re.compile(r"\.part-(\d{5})-of-(\d{5})$")

# what each kind is, in a message ("... holds X, not Y")
WHAT = {"parquet": "parquet shards",
        "pretokenized": "a pretokenize output (.bin/.idx pairs in train/ and val/)",
        "buckets": "mixture buckets (.bin/.idx pairs in train/<bucket>/ and val/<bucket>/)"}
# what a caller wants -> the kind it reads or writes; "output" and "bucket output" are pretokenize's
# --output without and with --bucket
WANTED = {"parquet": "parquet", "pretokenized": "pretokenized", "buckets": "buckets",
          "output": "pretokenized", "bucket output": "buckets"}
PRETOKENIZED_LOADER = ("nanochat.dataloader."
                       "pretokenized_distributed_data_loader_with_state_bos_bestfit")
MIXTURE_LOADER = "nanochat.mixture.pretokenized_mixture_loader_with_state_bos_bestfit"


def _has_pairs(directory: str) -> bool:
    return os.path.isdir(directory) and bool(list_token_shards(directory))


def data_kind(directory: str) -> str:
    """The kind of data directory holds: "parquet", "pretokenized", "buckets", "pairs", "empty",
    "missing" or "file" (see the module docstring)."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        return "file"
    if not os.path.isdir(directory):
        return "missing"
    # parquet first: a directory with parquet shards is a dataset, whatever else it holds
    if any(name.endswith(".parquet") for name in os.listdir(directory)):
        return "parquet"
    if _has_pairs(directory):
        return "pairs"
    for split in SPLITS:
        split_dir = os.path.join(directory, split)
        if _has_pairs(split_dir):
            return "pretokenized"
        if os.path.isdir(split_dir) and any(_has_pairs(os.path.join(split_dir, n))
                                            for n in os.listdir(split_dir)):
            return "buckets"
    return "empty"


def _fix(directory: str, kind: str, wanted: str) -> str:
    """What to do instead, for directory holding `kind` data where `wanted` was asked for."""
    d = os.path.normpath(directory)
    if kind == "parquet":
        if wanted in ("output", "bucket output"):
            return f"pretokenized shards go to a directory of their own, e.g. --output {d}_tokens"
        bucket = " --bucket NAME" if wanted == "buckets" else ""
        return (f"pretokenize them into a new directory: python -m nanochat.pretokenize --input "
                f"{d} --output {d}_tokens{bucket}, then pass {d}_tokens")
    if kind == "pretokenized":
        if wanted == "parquet":
            return (f"read it with {PRETOKENIZED_LOADER}, or pass the directory of the parquet "
                    "shards")
        if wanted == "bucket output":
            return (f"buckets go to a directory of their own, e.g. --output {d}_buckets --bucket "
                    "NAME")
        return (f"read it with {PRETOKENIZED_LOADER}; for a mixture, pretokenize each bucket into "
                f"a new directory (python -m nanochat.pretokenize --input ... --output {d}_buckets "
                "--bucket NAME) and pass that")
    assert kind == "buckets", kind  # describe_mismatch never asks about pairs, empty or missing
    if wanted == "output":
        return "add --bucket NAME to write one more bucket there, or pass a new --output directory"
    one = "" if wanted == "parquet" else " (a curriculum of one bucket reads that bucket alone)"
    also = ", or pass the directory of the parquet shards" if wanted == "parquet" else ""
    return f"read them with {MIXTURE_LOADER}{one}{also}"


def _file_fix(path: str, wanted: str) -> str:
    """What to pass instead of a file given as a data directory: the directory that holds it, or
    the whole output around that one (a pair sits in DIR/train/ or in DIR/train/<bucket>/)."""
    parent = os.path.dirname(os.path.normpath(path)) or "."
    enclosing = _enclosing(parent) if data_kind(parent) == "pairs" else None
    home = enclosing[0] if enclosing else parent
    if data_kind(home) == WANTED[wanted]:
        return f"pass {home}, " + ("the directory it is in" if home == parent else
                                   f"which holds {parent}, the directory it is in")
    return f"the file is in {parent}"


def _enclosing(directory: str) -> tuple[str, str, str | None] | None:
    """(data directory, what directory is in it, bucket name or None) when directory is one
    split's directory of a pretokenize output, or one bucket's directory of a mixture's data (which
    need not exist yet); else None. The data directory is relative when directory is."""
    path = os.path.abspath(directory)
    parent, name = os.path.split(path)
    grandparent, split = os.path.split(parent)
    # messages show paths as the user gave them: relative in, relative out
    shown = (lambda p: p) if os.path.isabs(directory) else os.path.relpath
    if name in SPLITS and data_kind(parent) in ("pretokenized", "buckets"):
        whole = "pretokenize output" if data_kind(parent) == "pretokenized" else "mixture data"
        return shown(parent), f"the {name}/ directory of the {whole} {shown(parent)}", None
    if split in SPLITS and data_kind(grandparent) == "buckets":
        return (shown(grandparent),
                f"the directory of bucket {name!r} in the mixture data {shown(grandparent)}", name)
    return None


def check_kind(directory: str, wanted: str) -> None:
    """ValueError (describe_mismatch's message) when directory holds another kind of data than
    wanted."""
    mismatch = describe_mismatch(directory, wanted)
    if mismatch:
        raise ValueError(mismatch)


def describe_mismatch(directory: str, wanted: str) -> str | None:
    """A message for a directory that holds another kind of data than the caller reads or writes:
    what it holds, and what to pass instead. wanted: "parquet" (the parquet loader, the dataset
    listing),
    "pretokenized" (the pretokenized loader), "buckets" (a mixture), "output" or "bucket output"
    (pretokenize's --output without or with --bucket). None when directory holds the wanted kind, or
    nothing of ours (then it is the caller's to say what is missing)."""
    if wanted not in WANTED:
        raise ValueError(f"wanted must be one of {sorted(WANTED)}, got {wanted!r}")
    kind = data_kind(directory)
    writing = wanted in ("output", "bucket output")
    label = "--output " if writing else ""  # a message about pretokenize names its flag
    if kind == "file":
        if writing:
            return f"--output {directory} is a file, not a directory: pass a new directory"
        return (f"{directory} is a file, not a directory: data_dir must be the directory that "
                f"holds {WHAT[WANTED[wanted]]}; {_file_fix(directory, wanted)}")
    if kind == "pairs" or (writing and kind in ("missing", "empty")):
        # a directory inside a data directory (when writing, a new one too): say which, and fit
        # the whole
        enclosing = _enclosing(directory)
        if enclosing is not None:
            whole, what, bucket = enclosing
            if writing and bucket:
                fix = f"pass --output {whole} --bucket {bucket}"
            else:  # whole holds pretokenized data or buckets: this recursion ends there
                fix = describe_mismatch(whole, wanted) or f"pass {label}{whole}"
            return f"{label}{directory} is {what}: {fix}"
        if kind == "pairs":
            return (f"{label}{directory} holds .bin/.idx pairs itself, but the loaders read them "
                    "from DIR/train/ and DIR/val/ (a pretokenize output) or DIR/train/<bucket>/ "
                    "(mixture buckets): "
                    + ("pass a new --output directory" if writing else "pass such a directory DIR"))
    if kind in ("missing", "empty", WANTED[wanted]):  # the caller says what is missing, if anything
        return None
    return (f"{label}{directory} holds {WHAT[kind]}, not {WHAT[WANTED[wanted]]}: "
            f"{_fix(directory, kind, wanted)}")



def list_token_shards(data_dir: str) -> list[str]:
    """Sorted prefixes of the complete pairs (an .idx with its .bin) directly in data_dir; the
    parts of a split input in order, where its unsplit pair would sort. Temporary files of a killed
    run (*.tmp) and a .bin without its .idx are never listed."""
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"token shard directory {data_dir} does not exist; write shards "
                                "first: python -m nanochat.pretokenize --input ... --output ...")
    prefixes = []
    for name in sorted(os.listdir(data_dir), key=_pair_order):
        prefix = os.path.join(data_dir, name[:-len(".idx")])
        # isfile: a directory named x.idx is no pair; the .bin check skips a half-deleted one
        if (name.endswith(".idx") and os.path.isfile(prefix + ".idx")
                and os.path.isfile(prefix + ".bin")):
            prefixes.append(prefix)
    return prefixes


def part_name(name: str, part: int, parts: int) -> str:
    """The pair name of part `part` of `parts` of the input NAME: NAME itself when it is whole."""
    return name if parts == 1 else f"{name}.part-{part:05d}-of-{parts:05d}"


def whole_name(name: str) -> str:
    """The input name a pair name was made from: NAME.part-K-of-N -> NAME; a whole one as is."""
    return PART_SUFFIX.sub("", name)


def _pair_order(file: str) -> tuple[str, str]:
    """The order of a split's files: NAME.part-K-of-N.idx sorts as NAME.idx would, then by K."""
    stem, _, suffix = file.rpartition(".")
    base = whole_name(stem)
    return (file, "") if base == stem else (f"{base}.{suffix}", file)

"""
Seeded shuffling without stored lists: keyed permutations of [0, n) computed from a counter.
A shuffled loader walks each epoch's units (parquet row groups, or chunks of token shards) in a
permuted order dealt round-robin to the ranks, and reads the entries of each `window` consecutive
units of its share in a permuted order too. Both are functions of (seed, epoch, ...), so a resume
state stores positions, never a list, and every rank can compute any other rank's order (the elastic
merge needs that).

The permutation is a 4-round Feistel network with cycle-walking: a bijection of [0, n) for any n,
in plain integer arithmetic, so it is the same on every machine and numpy version (numpy's own
Generator streams may change). Cost: ~0.1 us per element, vectorised in numpy.

May import: numpy.
"""

import hashlib
from typing import NamedTuple

import numpy as np

# splitmix64's finaliser constants
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit avalanche mix (splitmix64's finaliser): every output bit depends on every input
    bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * _C1
    x = x ^ (x >> np.uint64(27))
    x = x * _C2
    return x ^ (x >> np.uint64(31))


def round_keys(*parts) -> np.ndarray:
    """Four 64-bit round keys from any ints and strings (seed, a purpose, epoch, ...)."""
    # repr, not hash(): str hashes are salted per process, and every rank must agree
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=32).digest()
    return np.frombuffer(digest, dtype="<u8").astype(np.uint64)  # 32 bytes: four keys


def permute(values, n: int, keys: np.ndarray) -> np.ndarray:
    """pi(values) for the keyed bijection pi of [0, n); values: ints in [0, n). int64 array."""
    # the domain 2**(2*half) holds n, and at most 4n: a walk averages at most 4 passes
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)

    def feistel(x):  # a bijection of [0, 2**(2*half)) whatever the round function
        left, right = x >> shift, x & mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << shift) | right

    out = feistel(np.asarray(values, dtype=np.uint64))
    outside = np.flatnonzero(out >= n)
    # cycle-walking: an output >= n is permuted again; each walk ends, since feistel is a
    # bijection of the domain, and only the elements still outside are recomputed
    while outside.size:
        out[outside] = feistel(out[outside])
        outside = outside[out[outside] >= n]
    return out.astype(np.int64)


def permutation(n: int, keys: np.ndarray) -> np.ndarray:
    """The keyed permutation of [0, n), as an int64 array."""
    return permute(np.arange(n), n, keys) if n else np.zeros(0, dtype=np.int64)


class WindowTable(NamedTuple):
    """One window of a rank's shuffled share of an epoch: what Shuffle.window_table returns."""
    places: list  # (pq_idx, rg_idx) of each of its units
    bounds: np.ndarray  # where each unit's entries start in the window, and the total at the end
    permutation: np.ndarray  # the window's entries, in the order they are read


class Shuffle:
    """The order a shuffled walk reads in: seed, and window (units whose entries are mixed
    together)."""

    def __init__(self, seed: int, window: int, name: str = ""):
        # name: a mixture's bucket, so that buckets of one seed get different orders
        self.seed, self.window, self.name = seed, window, name

    def bucket(self, name: str) -> "Shuffle":
        """This order for one bucket of a mixture: the same seed and window, another permutation."""
        return Shuffle(self.seed, self.window, name)

    def units(self, epoch: int, total: int, rank: int, world_size: int) -> np.ndarray:
        """Global unit indices rank reads in an epoch, in order: positions rank, rank + world_size,
        ... of the epoch's permutation of all units."""
        positions = np.arange(rank, total, world_size)
        if not total:  # permute needs n >= 1
            return positions
        return permute(positions, total, round_keys(self.seed, self.name, "units", epoch))

    def entries(self, epoch: int, rank: int, world_size: int, window: int, n: int) -> np.ndarray:
        """The order of the n entries of one window (the window-th of rank's share in this
        epoch)."""
        # rank and world_size in the key: each rank's windows get orders of their own
        return permutation(n, round_keys(self.seed, self.name, "entries", epoch, world_size, rank,
                                         window))

    def window_table(self, index, epoch: int, rank: int, world_size: int,
                     window: int) -> WindowTable:
        """One window of rank's share of an epoch. index: the split's units (total, locate,
        docs)."""
        first = window * self.window
        units = self.units(epoch, index.total, rank, world_size)[first:first + self.window]
        places = [index.locate(int(g)) for g in units]
        bounds = np.cumsum([0] + [index.docs(*place) for place in places])
        return WindowTable(places, bounds,
                           self.entries(epoch, rank, world_size, window, int(bounds[-1])))

    @staticmethod
    def entry(table: WindowTable, i: int) -> tuple[int, int, int]:
        """(pq_idx, rg_idx, doc_index) of the i-th entry of a window's permutation."""
        places, bounds, permutation = table
        # the unit whose [start, next start) holds the entry: a binary search, not a table per entry
        u = int(np.searchsorted(bounds, permutation[i], side="right")) - 1
        return (*places[u], int(permutation[i] - bounds[u]))

    def plan_key(self, epoch: int, units: np.ndarray, total: int) -> np.ndarray:
        """A sort key for whole units dealt by an elastic merge: their order never depends on which
        others remain, so a plan saved half-read and resumed continues in the same order."""
        return permute(units, total, round_keys(self.seed, self.name, "plan", epoch))

    def plan_doc_indices(self, epoch: int, unit: int, n: int) -> np.ndarray:
        """The order of the n documents of a whole unit dealt by an elastic merge."""
        # the label "plan rows" seeds the order: a different one would deal other documents
        return permutation(n, round_keys(self.seed, self.name, "plan rows", epoch, unit))

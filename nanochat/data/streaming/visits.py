"""
Where a streaming loader's reader is in its order of shard visits, and what it reads next.
The one it reads, those fetched ahead, those it has read and not yet packed, and those it reads
later (the ledger's `later`, which eviction spares longest). No I/O, no lock: the shard cache calls
it holding its own. The order is looked at lazily, a few visits past the reader's.

May import: nothing of the project.
"""

import itertools

LOOKAHEAD = 64  # distinct shards of the order searched for the one the reader asks for
LATER_MAX = 256  # the most shards a loader lists as read soon (Loader.later)


class Visits:
    """The walk's file order, visit by visit, as far as looked: `move_to` the shard the reader
    opens, `deal` the file a state's walk goes on in."""

    def __init__(self, names: list[str], prefetch_shards: int, later_count: int):
        self.names, self.prefetch_shards, self.later_count = names, prefetch_shards, later_count
        self.upcoming = iter(())
        self.visits: list[tuple[int, int]] = []  # (epoch, pq_idx) of the order, as far as looked
        self.at: int | None = None  # the visit the reader is at
        self.dealt = 0  # the visit the last state's walk goes on in: all before it is packed
        self.first_seen: dict[int, int] = {}  # pq_idx -> where the order first names it

    def begin(self, upcoming) -> None:
        """Start along `upcoming`, an iterator of (epoch, pq_idx) visits, the reader at the
        first."""
        self.upcoming = upcoming
        self.fill(1)
        if self.visits:
            self.at = 0
        self.fill(self.prefetch_shards)

    def fill(self, count: int) -> None:
        """Look `count` visits past the reader's (or to the order's end)."""
        wanted = (-1 if self.at is None else self.at) + 1 + count - len(self.visits)
        for epoch, p in itertools.islice(self.upcoming, max(wanted, 0)):
            self.first_seen.setdefault(p, len(self.visits))
            self.visits.append((epoch, p))

    def move_to(self, p: int) -> bool:
        """Move the reader to shard p when it is among its next LOOKAHEAD visits; False (and the
        reader stays) when it is not."""
        self.fill(LOOKAHEAD)
        base = 0 if self.at is None else self.at + 1
        later = [q for _, q in self.visits[base:base + LOOKAHEAD]]
        if p not in later:
            return False
        self.at = base + later.index(p)
        self.fill(self.prefetch_shards)
        return True

    def deal(self, at) -> None:
        """A state's walk goes on in file `at` (epoch, pq_idx): every visit before it is packed."""
        for v in range(self.dealt, len(self.visits)):
            if self.visits[v] == tuple(at):
                self.dealt = v
                break

    def first_visit(self, p: int) -> int:
        """Where the order first names shard p (past all looked at when it has not yet)."""
        return self.first_seen.get(p, len(self.visits))

    def current(self) -> int | None:
        """The shard the reader is at (None before it starts)."""
        return None if self.at is None else self.visits[self.at][1]

    def ahead(self) -> list[int]:
        """The next prefetch_shards visits' shards."""
        if self.at is None:
            return []
        return [p for _, p in self.visits[self.at + 1:self.at + 1 + self.prefetch_shards]]

    def packing(self) -> set[int]:
        """The shards from where the last state's walk goes on to the reader's: documents read
        and not yet packed come from them (so a later state's buffer may hold some)."""
        if self.at is None:
            return set()
        return {p for _, p in self.visits[min(self.dealt, self.at):self.at + 1]}

    def later(self) -> tuple[str, ...]:
        """The shards this loader reads after those it needs, soonest first, as many as the budget
        could hold (later_count): the other local ranks' eviction keeps the soonest longest (a rank
        that lags, its row groups of a shard being more, finds them on disk, not fetched again)."""
        if not self.later_count or self.at is None:
            return ()
        self.fill(self.prefetch_shards + self.later_count)
        later = self.visits[self.at + 1 + self.prefetch_shards:]
        return tuple(dict.fromkeys(self.names[p] for _, p in later))[:self.later_count]

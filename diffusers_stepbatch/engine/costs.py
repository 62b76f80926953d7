"""Measured call times, and how to split a group of work items into calls (pure Python, no torch).

Batching is not free: a compute-bound forward of 8 rows can take longer than 8 forwards of one. `BatchCostModel`
picks the split with the least estimated time from measured times, normalized for the machine's load;
`PackingCostModel` chooses between one packed call and one call per shape. The algorithm and its knobs:
docs/concepts/cost-model.md.
"""

from __future__ import annotations

import statistics
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Hashable, Sequence


def partition(rows: Sequence[int], capacity: int) -> list[list[int]]:
    """Consecutive items grouped into chunks of at most `capacity` rows (a larger item stays whole)."""
    chunks: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, size in enumerate(rows):
        if current and filled + size > capacity:
            chunks.append(current)
            current, filled = [], 0
        current.append(index)
        filled += size
    if current:
        chunks.append(current)
    return chunks


def _sizes(item_rows: Sequence[int], option: list[list[int]]) -> list[int]:
    return [sum(item_rows[i] for i in chunk) for chunk in option]


def _probe(item_rows: Sequence[int], preferred: list[list[int]], probe_rows: int,
           lead: int) -> tuple[list[list[int]], int]:
    """One call of at most `probe_rows` rows among `preferred`'s: up to `lead` chunks of `preferred` first (so the
    probe is read against this group's load), the probe, then the rest as `preferred` splits. Returns the chunks
    and the probe's index."""
    capacity = max(_sizes(item_rows, preferred))
    probe_items = len(partition(item_rows, probe_rows)[0])
    chunks: list[list[int]] = []
    start = 0
    for chunk in preferred[:lead]:
        if len(item_rows) - start - len(chunk) < probe_items:
            break
        chunks.append(chunk)
        start += len(chunk)
    head = partition(item_rows[start:], probe_rows)[0]
    chunks.append([start + index for index in head])
    start += len(head)
    rest = partition(item_rows[start:], capacity)
    return chunks + [[start + index for index in chunk] for chunk in rest], len(chunks) - 1


def _ladder(item_rows: Sequence[int], capacity: int) -> list[list[int]]:
    """Chunks of at most `capacity`, `capacity` / 2, ..., 1 rows after the rest at `capacity`, smallest first: one
    exploring group measures every halving, before a decode's woken callers slow the calls after it."""
    chunks: list[list[int]] = []
    start, size = 0, capacity
    while start < len(item_rows) and size >= 1:
        chunk = [start + index for index in partition(item_rows[start:], size)[0]]
        chunks.append(chunk)
        start += len(chunk)
        size //= 2
    rest = partition(item_rows[start:], capacity)
    return [[start + index for index in chunk] for chunk in rest] + chunks[::-1]


def _halving_options(item_rows: Sequence[int]) -> list[list[list[int]]]:
    """Partitions for capacities total, total/2, total/4, ..., 1, without repeats."""
    options: list[list[list[int]]] = []
    capacity = sum(item_rows)
    while True:
        option = partition(item_rows, capacity)
        if not options or option != options[-1]:
            options.append(option)
        if capacity == 1:
            return options
        capacity = max(1, capacity // 2)


class BatchCostModel:
    """Online estimates of forward seconds by (key, rows); chooses how to split groups.

    >>> costs = BatchCostModel()
    >>> costs.observe("flux-64x64", rows=8, seconds=0.9)
    >>> costs.chunk("flux-64x64", [1, 1, 2, 1, 1, 1, 1])   # index lists, one per forward
    """

    def __init__(self, window: int = 5, explore_every: int = 50, split_margin: float = 0.05,
                 explore_tolerance: float = 0.25, explore_first: int = 5):
        self.window = window
        self.explore_every = explore_every
        self.explore_first = explore_first  # NOTE: re-measure soon at first, so an early outlier stops deciding
        self.split_margin = split_margin  # NOTE: differences within noise must not break groups up
        # NOTE: explore until a split clearly loses, not until one stops helping: per-row cost need not be monotonic.
        self.explore_tolerance = explore_tolerance
        self._samples: dict[Hashable, dict[int, deque[float]]] = defaultdict(dict)  # seconds / the load level then
        self._levels: dict[Hashable, deque[float]] = defaultdict(lambda: deque(maxlen=self.window))
        self._decisions: Counter = Counter()
        self._concluded: set[Hashable] = set()
        self._largest_run: dict[Hashable, int] = {}  # per key: the most rows of any call so far
        self._warm_ups: dict[Hashable, set[int]] = defaultdict(set)  # per key: row counts run but not recorded
        self._reexplorations: Counter = Counter()  # per key: re-measurements so far
        self._next_reexploration: dict[Hashable, int] = {}  # per key: the decision that re-measures next
        self._remeasuring: dict[Hashable, int] = {}  # per key: the row count a re-measurement runs, until observed
        self._last_preferred: dict[Hashable, tuple[int, int]] = {}  # per key: (option index, rows per call) preferred
        self._confirming: dict[Hashable, tuple[int, int]] = {}  # per key: (decision, rows per call) to measure again

    def observe(self, key: Hashable, rows: int, seconds: float, new_size_warms_up: bool = False) -> None:
        """Record a call of `rows` rows that took `seconds`; `new_size_warms_up`: the first call at any row count
        is a warm-up (the engine says so for calls timed by CUDA events)."""
        # NOTE: first calls pay one-time costs (lazy init, allocator growth; on CUDA per-shape cuDNN and cuBLAS
        # plans): a key's first, one with more rows than ever, and on CUDA any new row count, are not recorded.
        largest = self._largest_run.get(key)
        self._largest_run[key] = max(rows, largest or 0)
        if largest is None or rows > largest or (
                new_size_warms_up and rows not in self._warm_ups[key] and rows not in self._samples.get(key, {})):
            self._warm_ups[key].add(rows)
            return
        samples = self._samples[key].setdefault(rows, deque(maxlen=self.window))
        if self._remeasuring.get(key) == rows:
            # NOTE: a re-measurement starts its size's estimate afresh: its old samples date from another load.
            del self._remeasuring[key]
            samples.clear()
        reference = statistics.median(samples) if samples else 0.0
        if reference > 0 and seconds > 0:  # every call of a measured size measures the load (a 0 s call: none)
            self._levels[key].append(seconds / reference)
        if len(samples) < self.window:
            samples.append(seconds / self._load(key))
        # NOTE: a full window keeps its estimate; later calls only move the level (refreshing would leak the lag in).

    def _load(self, key: Hashable) -> float:
        """The key's load level: the median of its last calls' levels (one slow call moves no estimate); 1.0 until
        a measured size ran again."""
        levels = self._levels.get(key)
        return statistics.median(levels) if levels else 1.0

    def estimate(self, key: Hashable, rows: int) -> float | None:
        """Median measured seconds for `rows`, else linear interpolation between the nearest measured sizes."""
        measured = self._samples.get(key)
        if not measured:
            return None
        if rows in measured:
            return statistics.median(measured[rows]) * self._load(key)
        sizes = sorted(measured)
        below = [s for s in sizes if s < rows]
        above = [s for s in sizes if s > rows]
        if below and above:
            lo, hi = below[-1], above[0]
            t_lo, t_hi = self.estimate(key, lo), self.estimate(key, hi)
            return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)
        nearest = below[-1] if below else above[0]
        # NOTE: outside the measured range assume cost proportional to rows: no batching gain is invented.
        return self.estimate(key, nearest) * rows / nearest

    def is_measured(self, key: Hashable, rows: int) -> bool:
        """Measured at `rows`, or at sizes on both sides of it (then `estimate` interpolates)."""
        measured = self._samples.get(key, {})
        return rows in measured or (any(size < rows for size in measured) and any(size > rows for size in measured))

    def _known_enough(self, key: Hashable, rows: int) -> bool:
        """Whether exploration may take `estimate` for `rows` instead of running it: measured, interpolated, or
        above the largest measured size by at most a factor of 2 (its halves are measured, and the rows-scaled
        estimate ranks it against them as a measurement would)."""
        measured = self._samples.get(key)
        if not measured:
            return False
        return self.is_measured(key, rows) or max(measured) < rows <= 2 * max(measured)

    def chunk(self, key: Hashable, item_rows: Sequence[int]) -> list[list[int]]:
        """Split items (given by their row counts) into forwards; returns index lists in order."""
        if len(item_rows) <= 1:
            return [list(range(len(item_rows)))]
        options = _halving_options(item_rows)
        decision = self._decisions[key]
        self._decisions[key] += 1
        if key not in self._concluded:  # explore: the whole group, then the halvings, until a split clearly loses
            fastest = None
            for option in options:
                cost = self._measured_cost(key, item_rows, option)
                if cost is None:
                    if self._only_warmed_up(key, item_rows, option):
                        continue  # NOTE: not run again to measure it: the next split first (see _only_warmed_up)
                    if len(option) == 1:
                        return option  # the whole group first: where batching pays, it is the choice
                    return _ladder(item_rows, max(_sizes(item_rows, option)))
                if fastest is not None and cost > fastest * (1 + self.explore_tolerance):
                    break
                fastest = cost if fastest is None else min(fastest, cost)
            self._concluded.add(key)
        best = self._preferred(self._estimates(key, item_rows, options))
        if not self.explore_every:
            return options[best]
        preferred = (best, max(_sizes(item_rows, options[best])))
        previous = self._last_preferred.get(key, preferred)
        self._last_preferred[key] = preferred
        if previous[0] != preferred[0] and previous[1] != preferred[1]:  # NOTE: not a group of another size
            # NOTE: a switch rests on one re-measurement; the split left is measured again soon to confirm it.
            self._confirming[key] = (decision + self.explore_first, previous[1])
        due, left = self._confirming.get(key, (None, None))
        if due is not None and decision >= due:
            del self._confirming[key]
            if left != preferred[1] and left <= sum(item_rows):
                return self._remeasure(key, item_rows, options[best], left)
        if decision >= self._next_reexploration.setdefault(key, self._interval(0) - 1):  # follow the load
            count = self._reexplorations[key]
            self._reexplorations[key] += 1
            self._next_reexploration[key] = decision + self._interval(count + 1)
            neighbours = [k for k in (best - 1, best + 1) if 0 <= k < len(options)]
            neighbour = options[neighbours[count % len(neighbours)]]
            return self._remeasure(key, item_rows, options[best], max(_sizes(item_rows, neighbour)))
        return options[best]

    def _remeasure(self, key: Hashable, item_rows: Sequence[int], preferred: list[list[int]],
                   probe_rows: int) -> list[list[int]]:
        """The preferred split with one call of up to `probe_rows` rows (`_probe`), whose estimate starts afresh."""
        probe, at = _probe(item_rows, preferred, probe_rows, self.window)
        self._remeasuring[key] = sum(item_rows[i] for i in probe[at])
        return probe

    def _only_warmed_up(self, key: Hashable, item_rows: Sequence[int], option: list[list[int]]) -> bool:
        """Whether `option` is the whole group in one call, not known yet, and run before as an unrecorded warm-up
        (exploration moves on rather than run a possibly slow whole group twice)."""
        if len(option) != 1:
            return False
        rows = sum(item_rows)
        return not self._known_enough(key, rows) and rows in self._warm_ups[key]

    def _interval(self, count: int) -> int:
        """Decisions between re-measurement `count` and the one before: explore_first, doubling, up to explore_every."""
        return min(self.explore_every, max(1, self.explore_first) * 2 ** min(count, 30))

    def split_estimate(self, key: Hashable, item_rows: Sequence[int]) -> float | None:
        """Estimated seconds for these items at the split `chunk` prefers; None before any call was measured."""
        if not self._samples.get(key):
            return None
        estimates = self._estimates(key, item_rows, _halving_options(item_rows))
        return estimates[self._preferred(estimates)]

    def _estimates(self, key: Hashable, item_rows: Sequence[int], options: list[list[list[int]]]) -> list[float]:
        return [sum(self.estimate(key, size) for size in _sizes(item_rows, option)) for option in options]

    def _preferred(self, estimates: Sequence[float]) -> int:
        """The option with the fewest forwards among those within `split_margin` of the fastest estimate."""
        fastest = min(estimates)
        return next(k for k, estimate in enumerate(estimates) if estimate <= fastest * (1 + self.split_margin))

    def _measured_cost(self, key: Hashable, item_rows: Sequence[int], option: list[list[int]]) -> float | None:
        sizes = _sizes(item_rows, option)
        if not all(self._known_enough(key, size) for size in sizes):
            return None
        return sum(self.estimate(key, size) for size in sizes)

    def rows_within(self, key: Hashable, seconds: float, limit: int) -> int:
        """The most rows (<= limit) whose estimated forward time stays within `seconds` (at least 1)."""
        best = 1
        for rows in range(1, limit + 1):
            estimate = self.estimate(key, rows)
            if estimate is not None and estimate <= seconds:
                best = rows
        return best


# A group of several shapes that could pack: ((per-shape key, rows), ...) in a canonical order.
PackSignature = tuple[tuple[Hashable, int], ...]


class PackingCostModel:
    """Packed call or one call per shape, for work items of several shapes that can pack.

    Packed calls are measured per signature (shapes and rows); unseen signatures are estimated from the measured
    ones' ratio to their per-shape calls (`BatchCostModel`). Unknown costs are explored, packed first, and the
    losing option is measured again now and then.

    >>> costs = BatchCostModel()
    >>> packing = PackingCostModel(costs)
    >>> packing.should_pack("flux", [("flux-32x32", 2), ("flux-64x64", 1)])
    True
    """

    def __init__(self, per_shape: BatchCostModel, window: int = 5, explore_every: int = 50,
                 margin_per_interval: float = 0.1, max_interval_scale: int = 8, max_signatures: int = 20):
        self.per_shape = per_shape
        self.window = window
        self.max_signatures = max_signatures  # NOTE: traffic of many sizes forms ever new mixes; keep the recent ones
        self.explore_every = explore_every
        # NOTE: re-measuring the losing option costs their difference; the further apart they are, the rarer.
        self.margin_per_interval = margin_per_interval
        self.max_interval_scale = max_interval_scale
        self._next_reexploration: dict[Hashable, int] = {}
        self._packed: dict[Hashable, OrderedDict[PackSignature, deque[float]]] = defaultdict(OrderedDict)
        self._warmed: set[tuple[Hashable, PackSignature]] = set()
        self._decisions: Counter = Counter()

    @staticmethod
    def signature(parts: Sequence[tuple[Hashable, int]]) -> PackSignature:
        return tuple(sorted(parts, key=repr))

    def separate_estimate(self, parts: Sequence[tuple[Hashable, int]],
                          item_rows: Sequence[Sequence[int]] | None = None) -> float | None:
        """The per-shape calls' estimated seconds: each shape's rows in one call, or, given each shape's items'
        row counts, each shape at the split the per-shape model would choose for them (what the engine would
        run instead of the packed call)."""
        if item_rows is None:
            estimates = [self.per_shape.estimate(key, rows) for key, rows in parts]
        else:
            estimates = [self.per_shape.split_estimate(key, items) for (key, _), items in zip(parts, item_rows)]
        return None if any(e is None for e in estimates) else sum(estimates)

    def packed_estimate(self, pack_key: Hashable, parts: Sequence[tuple[Hashable, int]]) -> float | None:
        samples = self._packed[pack_key].get(self.signature(parts))
        if samples:
            return statistics.median(samples)
        separate, ratio = self.separate_estimate(parts), self._packed_ratio(pack_key)
        return None if separate is None or ratio is None else separate * ratio

    def _packed_ratio(self, pack_key: Hashable) -> float | None:
        """Median over the measured signatures of packed time / their per-shape calls' estimate now (at decision
        time: packed calls are explored before their shapes' own calls, and estimates move with the load)."""
        ratios = []
        for signature, samples in self._packed[pack_key].items():
            separate = self.separate_estimate(signature)
            if separate:
                ratios.append(statistics.median(samples) / separate)
        return statistics.median(ratios) if ratios else None

    def should_pack(self, pack_key: Hashable, parts: Sequence[tuple[Hashable, int]],
                    item_rows: Sequence[Sequence[int]] | None = None) -> bool:
        """Whether these shapes' rows should run as one packed call; `item_rows` (per shape, its work items'
        row counts) lets the per-shape side be estimated at its own best split."""
        decision = self._decisions[pack_key]
        self._decisions[pack_key] += 1
        packed = self.packed_estimate(pack_key, parts)
        if packed is None:
            return True  # explore the packed call first
        separate = self.separate_estimate(parts, item_rows)
        if separate is None:
            return False  # measure the per-shape calls
        choice = packed <= separate
        if self.explore_every and decision >= self._next_reexploration.setdefault(pack_key, self.explore_every - 1):
            self._next_reexploration[pack_key] = decision + self._interval(packed, separate)
            return not choice
        return choice

    def _interval(self, packed: float, separate: float) -> int:
        """Decisions until the next re-measurement, given the two options' current estimates."""
        margin = abs(packed - separate) / max(min(packed, separate), 1e-12)
        scale = min(self.max_interval_scale, 1 + margin / self.margin_per_interval)
        return max(1, round(self.explore_every * scale))

    def observe(self, pack_key: Hashable, parts: Sequence[tuple[Hashable, int]], seconds: float) -> None:
        """Record a packed call's time (the first call of a signature pays one-time costs and is skipped)."""
        signature = self.signature(parts)
        if (pack_key, signature) not in self._warmed:
            self._warmed.add((pack_key, signature))
            return
        measured = self._packed[pack_key]
        measured.setdefault(signature, deque(maxlen=self.window)).append(seconds)
        measured.move_to_end(signature)
        while len(measured) > self.max_signatures:
            measured.popitem(last=False)

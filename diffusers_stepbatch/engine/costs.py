"""BatchCostModel: measured forward times per (compatibility key, rows), and how to chunk a group.

Batching is not free: a compute-bound forward of 8 rows can take longer than 8 forwards of one row. The
engine reports every call's time here; when a group of work items is ready, `chunk()` picks the split
into forwards with the least estimated total time. Splits not measured yet are tried: the whole group first,
then one group that runs a call each of a half, a quarter, ... one row (`_ladder`); exploration ends at a split
clearly slower than the best so far. A size between two measured sizes, or above them by at most a factor of 2,
is estimated instead of explored, so that traffic whose group sizes change every time (2 + 6 rows, then 1 + 7,
...; at 32 requests 11, 20, 6, 26, ...) concludes in a few groups. A neighbouring size of the preferred split is
measured again after `explore_first` decisions, then ever less often, down to every `explore_every` decisions,
so the estimates follow the machine's load; one call of that size measures it, the rest of the group runs at
the preferred split, and that size's estimate starts again from the new measurement. Estimates are relative to the
key's load level: a size's first `window` calls since it was (re)measured set its estimate (each divided by the
level at its time), every call of a measured size moves the level, and every size's estimate follows the level
alike. So a size measured in a quiet moment is not compared, unscaled, with one measured in a busy one. A switch
to another split is checked by measuring the split left again a few decisions later.
Pure Python: no torch, tested with made-up timings.
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
    """One call of at most `probe_rows` rows among `preferred`'s: up to `lead` chunks of `preferred` first, then the
    probe, then the rest as `preferred` splits (at its largest chunk). Returns the chunks and the probe's index.

    NOTE: measuring a neighbouring size needs one call of it, not the whole group at that size: where one image
    per decode call is fastest (a CPU's VAE: 25 ms, two images 69 ms), re-measuring the 2-row neighbour as a
    group of 8 decodes ran 4 x 69 ms instead of 8 x 25 ms; one 2-row call costs 19 ms more. The preferred calls
    before it set the load level its time is read against (`BatchCostModel.observe`): a burst's first
    decodes ran faster than the previous burst's last ones, whose level a probe run first was read against (a
    2-row probe then looked as fast as two 1-row calls, and the next burst decoded 2 images per call).
    """
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
    """Chunks of at most `capacity`, `capacity` / 2, ..., 1 rows, and the rest at `capacity`; run smallest first,
    after the rest.

    NOTE: one exploring group measures every halving size below `capacity` at once. Run one split per
    decision, the sizes of a key whose groups come once per burst (a closed loop's decodes and encodes) took
    a round each: at 32 requests, six rounds of whole groups at sizes slower than the best by up to 2x. Small
    calls first: a decode call finishes its requests, whose callers then run under the GIL during the next calls.
    Run last, the one-row decodes of a burst of 32 were timed after 30 callers woke, at 23 ms instead of 16, and
    8 images per call (24 ms an image) looked as fast; large calls spread that over many rows.
    """
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
        # NOTE: re-measurements come every `explore_first` decisions at first, then twice as far apart each time,
        # up to `explore_every`: an early sample taken while callers' prologues held the GIL (16 rows: 21.6 ms,
        # later 16 ms) otherwise kept a key split for ~100 decisions.
        self.explore_first = explore_first
        # NOTE: a split must be estimated this much faster than fewer forwards to be chosen: on a noisy (shared)
        # machine, differences within measurement noise otherwise flip groups into needless splits.
        self.split_margin = split_margin
        # NOTE: exploration goes on to smaller splits until one is this much slower than the best so far. Not
        # "until a split stops helping": per-row cost need not be monotonic (a CPU's VAE decoded 6 rows as fast
        # as 2 x 3, and one row 1.5x faster per row), and an overhead-bound model's halves lose by far more.
        self.explore_tolerance = explore_tolerance
        self._samples: dict[Hashable, dict[int, deque[float]]] = defaultdict(dict)  # seconds / the load level then
        # per key: the load levels its last calls of measured sizes implied (their time / their size's estimate)
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
        # NOTE: a key's first call, and a first call with more rows than any before it, pay one-time costs (lazy
        # init, allocator pools growing); one such outlier would otherwise decide the exploration, so they are not
        # recorded. (Recording them until a second call replaced them was tried: a first 2-row image-encode call
        # at 2.7x its later time split that key's groups.) On the CPU a call with fewer rows than an earlier one
        # reuses that memory and is recorded at once: at 32 requests decode groups have a new size nearly every
        # time (11, 20, 6, 26, 3, 29, ... rows), and discarding every first call kept 16 whole-group decodes
        # exploring. On CUDA the first call at any new row count pays one-time costs, not only a larger one (cuDNN
        # attention builds an execution plan per shape, cuBLAS picks kernels per shape); recorded, those first calls
        # make every size but the first look slow: in a profiled H200 round (Flux at FLUX.1 width) eight prompts
        # were encoded one by one, and one forward took 112 ms against 25 ms for the others (`new_size_warms_up`).
        largest = self._largest_run.get(key)
        self._largest_run[key] = max(rows, largest or 0)
        if largest is None or rows > largest or (
                new_size_warms_up and rows not in self._warm_ups[key] and rows not in self._samples.get(key, {})):
            self._warm_ups[key].add(rows)
            return
        samples = self._samples[key].setdefault(rows, deque(maxlen=self.window))
        if self._remeasuring.get(key) == rows:
            # NOTE: a re-measurement starts its size's estimate afresh. The samples it replaces date from when
            # that size was last chosen, perhaps hundreds of decisions ago under another load, while the preferred
            # size's are recent: at 16 tiny Flux requests two 16-row forwards timed in the first burst (47 and 38
            # ms, later 22-28 ms) kept the median of [47, 38, 28] above two 8-row calls (2 x 15 ms), and the
            # denoise steps split for ~100 decisions. A re-measurement that was low by chance costs a few steps:
            # the size it makes preferred is measured again at its next calls, until its window is full.
            del self._remeasuring[key]
            samples.clear()
        reference = statistics.median(samples) if samples else 0.0
        if reference > 0 and seconds > 0:  # every call of a measured size measures the load (a 0 s call: none)
            self._levels[key].append(seconds / reference)
        if len(samples) < self.window:
            samples.append(seconds / self._load(key))
        # NOTE: a size measured `window` times keeps its estimate (relative to the load level). Were its later calls
        # to refresh its samples, each lagging level would leak into them, and the split between the two drift: in
        # a simulation where each group's load rose from 1 to 1.6, one-row decodes' own estimate rose 60% while the
        # level fell, until 8-row calls, measured once, looked faster.

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
        above the largest measured size by at most a factor of 2.

        NOTE: above, `estimate` scales the largest measured size's time by rows (no batching gain invented). A
        group of up to twice that size has its halves within the measured sizes; if per-row cost falls with rows
        (overhead-bound) the scaled estimate ranks the whole group at least as well as its halves, and if it
        rises (compute-bound) below them, so the choice is the one a measurement would lead to. Below the
        smallest measured size the scaled estimate ties every split with the whole group, so those are explored.
        """
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
        if key not in self._concluded:
            # Explore by halving: the whole group, then halves, quarters... until a split clearly loses.
            # Once concluded, other group sizes are estimated by interpolation instead of explored again.
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
            # NOTE: a switch rests on one re-measurement, read against a load level that may lag (a burst's first
            # calls after the last burst's busy tail): the split left is measured again soon, against the level
            # of the new one's calls, and a switch made on a biased reading goes back within a few decisions.
            self._confirming[key] = (decision + self.explore_first, previous[1])
        due, left = self._confirming.get(key, (None, None))
        if due is not None and decision >= due:
            del self._confirming[key]
            if left != preferred[1] and left <= sum(item_rows):
                return self._remeasure(key, item_rows, options[best], left)
        if decision >= self._next_reexploration.setdefault(key, self._interval(0) - 1):
            # re-measure a neighbour of the best option so the choice follows the machine's current load
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
        """Whether `option` is the whole group in one call, not known yet, and run before as an unrecorded warm-up.

        NOTE: exploration goes on to the next split instead of running it again: a burst's whole group can be the
        slowest option by far (32 decodes of a CPU's tiny VAE in one call: 1.65 s, one by one 0.6 s), and once
        a smaller size is measured the whole group is estimated from it (`_known_enough`) and measured when
        chosen. Smaller sizes are run again: a warm-up at one row must not keep one-row calls from being measured.
        """
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

    Per-shape calls are estimated by the engine's `BatchCostModel`; packed calls are measured per signature
    (which shapes, how many rows each) and, for signatures not seen yet, estimated from the ratio of the measured
    signatures' packed times to their per-shape calls' current estimates, under the same pack key. Unknown costs are
    explored (packed first, then per shape), and the other option is measured again now and then (after
    `explore_every` decisions, then the further apart the more the two options' estimates differ), so a machine
    or model where packing doesn't pay keeps its shapes apart.

    >>> costs = BatchCostModel()
    >>> packing = PackingCostModel(costs)
    >>> packing.should_pack("flux", [("flux-32x32", 2), ("flux-64x64", 1)])
    True
    """

    def __init__(self, per_shape: BatchCostModel, window: int = 5, explore_every: int = 50,
                 margin_per_interval: float = 0.1, max_interval_scale: int = 8, max_signatures: int = 20):
        self.per_shape = per_shape
        self.window = window
        # NOTE: per pack key, the most recently measured mixes are kept (traffic of many sizes forms ever new
        # ones); the others are estimated from their ratio, which every unseen mix's decision reads.
        self.max_signatures = max_signatures
        self.explore_every = explore_every
        # NOTE: re-measuring the other option costs their difference every time (measured on the overhead-bound
        # mix of benchmarks/mixed_resolution.py: a per-shape step, 4 calls instead of one, +8-13 ms in a ~75 ms
        # round every ~6 rounds). Where the two were measured far apart, only a change in load that large could
        # flip the choice, so each `margin_per_interval` of relative difference adds one `explore_every` to the
        # wait for the next re-measurement, up to `max_interval_scale` times it.
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
        """Median over the measured signatures of packed time / their per-shape calls' estimate now.

        NOTE: read at decision time, not when the packed call ran: packed calls are explored first, before
        their shapes' own calls are measured, and per-shape estimates move with the load.
        """
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

"""The policy: what memsentry measures in the next iteration, decided from the facts of the
iterations so far. Pure: no hooks, no clock, no torch. Its inputs are plain values (the time
account, what the iteration that ended cost, the window of layers, the iteration signal) and
its output is an :class:`IterationPlan`; the probes apply a plan, the state records what they
saw (docs/architecture.md draws the three).

Why iteration N is measured, in order of the checks in :func:`plan_next`:

1. ``track(overhead=None)``: every iteration is sampled, every call measured.
2. One of the first :attr:`Tuning.sampled_first` iterations: sampled whatever the account
   holds, so that every layer has figures from the start.
3. Otherwise the account decides: an iteration is *sampled* when it holds what a sampled
   iteration costs over a light one (:func:`shortfall` is zero or less), else *light*: only its
   boundaries are read, and no layer keeps its hooks.

The account (:class:`Account`) earns ``share`` of the loop's own time at every iteration, and
pays for measuring (hooks, boundaries, parts) and judging (censuses, rules). A census due
takes the first claim on it (:func:`census_step`). Inside a sampled iteration, measuring
stops at layers already measured once it has :func:`overdrawn` the account. The window of
layers measured (:func:`next_window`) shrinks when measuring every layer call takes more than
the budget's share, and moves on each iteration so every layer keeps being measured.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Tuning:
    """Every tuning figure of the policy, in one place.

    - ``sampled_first``: iterations sampled (and measured in full) whatever the account holds.
    - ``first_share``: in those, measuring stops at layers already measured once memsentry's
      own time in the iteration passes this share of the loop's time in it so far ...
    - ``floor``: ... and passes this many seconds. Below it an iteration's own time is never
      too dear: a loop of small steps keeps its whole window.
    - ``first_noted``: memsentry's seconds in the first iterations past which the report says
      what they cost.
    - ``sampled_decay``: how the price of a sampled iteration falls back after a dear one, at
      each sampled iteration that cost less.
    - ``census_guess``: what a census costs until one was clocked (5 to 30 ms here).
    - ``startup_credit``, ``startup_share``: the seconds of the program's life before tracking
      credited to judging, at most, and the share of them it may spend (never more than the
      tracker's own share).
    - ``read_share``: the share of the budget that reading light iterations' boundaries takes.
    - ``max_passed``: boundaries passed with a count only, in a row, at most.
    - ``length_share``: the share of the budget that reading the lengths of the containers
      found growing takes at boundaries passed with a count (each reading: microseconds).
    - ``first_census``: the iteration of the first census (after the warm-up the rules skip).
    - ``always_taken``: the schedule's first censuses, taken when due whatever the account
      holds (iterations 2, 3, 4, 6, 10, 18 and 34): they decide a short run's trends, and a
      rule that saw fewer would take a list bounded by hand for a leak (three points rise
      while it fills). They are counted by their place in the schedule: a census that growth
      asked for in between (``watch()``) is paid from the account and takes none of them.
    - ``still_bytes``: how far glibc's in-use heap count may move between two censuses of
      a loop that keeps nothing and still count as standing: measured here, a training step
      of a small model moves it by 0 to 96 bytes from one iteration to the next, while one
      tensor kept costs 360 bytes and more (its ``TensorImpl``, its storage, its data). Half
      of that is the resolution: a tensor kept while 240 bytes or more were freed elsewhere
      can pass unseen until the next census taken.
    - ``carry_gap``: iterations since the census taken before a census may be carried in
      its place: a tensor kept every iteration has then moved the heap by 2.9 KB at least,
      beyond the steps of 100 bytes to 1.1 KB seen where something else is freed or a cache
      grows once (one such step can hide a tensor: a list that gained one in four iterations
      was carried with a gap of 4).
    """

    sampled_first: int = 3
    first_share: float = 0.25
    floor: float = 2e-3
    first_noted: float = 0.1
    sampled_decay: float = 0.8
    census_guess: float = 0.02
    startup_credit: float = 10.0
    startup_share: float = 0.05
    read_share: float = 0.5
    max_passed: int = 256
    length_share: float = 0.25
    first_census: int = 2
    always_taken: int = 7
    still_bytes: int = 128
    carry_gap: int = 8


#: The tuning memsentry runs with.
DEFAULT = Tuning()


class Kind(enum.Enum):
    """How an iteration is measured."""

    SAMPLED = "sampled"  # every layer call in the window measured, the parts read
    LIGHT = "light"  # only its boundaries read


class HookState(enum.Enum):
    """Which module hooks an iteration keeps (:mod:`memsentry.record.hooks`)."""

    WINDOW = "window"  # the layers in the window, and the anchors (outermost modules)
    ANCHORS = "anchors"  # a light iteration: the anchors only
    LEAN = "lean"  # a light one ended by the first outermost module's next call: that one
    BARE = "bare"  # a light one ended by an optimizer step, t.step() or a seen backward: none


@dataclass(frozen=True)
class Account:
    """memsentry's time account at a boundary (seconds). ``share``: the budget, a share of
    the loop's own time (``None``: no limit). ``credit``: given for the program's life before
    tracking, for judging only. ``reserved``: put aside for a census that waits."""

    share: float | None
    loop: float = 0.0
    credit: float = 0.0
    spent: float = 0.0
    judged: float = 0.0
    reserved: float = 0.0
    iterations: int = 0
    sampled_price: float = 0.0
    light_price: float = 0.0

    @property
    def held(self) -> float:
        """What the account holds (``inf`` without a limit)."""
        return held(self.share, self.loop, self.credit, self.spent, self.judged)

    @property
    def bank(self) -> float:
        """What measuring may still spend (:func:`bank`)."""
        return bank(self.held, self.credit, self.judged, self.reserved)


def held(share: float | None, loop: float, credit: float, spent: float,
         judged: float) -> float:
    """What the account holds: ``share`` of the loop's time and the credit, less what
    measuring spent and judging judged (``inf`` without a limit)."""
    if share is None:
        return math.inf
    return share * loop + credit - spent - judged


def bank(held: float, credit: float, judged: float, reserved: float) -> float:
    """What measuring may still spend of what the account ``held``: not the credit judging
    has not spent, nor what a waiting census needs."""
    return held - max(0.0, credit - judged) - reserved


@dataclass(frozen=True)
class Ended:
    """What an iteration (or a run of ``iterations`` light ones) cost: ``seconds`` on the
    iteration clock, ``own`` of them memsentry's measuring; ``cut``: a sampled one stopped
    measuring half way (:func:`overdrawn`)."""

    index: int
    seconds: float
    own: float
    light: bool = False
    cut: bool = False
    iterations: int = 1


@dataclass(frozen=True)
class Window:
    """The layers measured in a sampled iteration: ``size`` of the ``layers`` known, from
    ``offset`` on (wrapping); ``size`` is ``inf`` for all of them."""

    layers: int = 0
    size: float = math.inf
    offset: int = 0

    @property
    def full(self) -> bool:
        return self.size >= self.layers

    def measures(self, index: int) -> bool:
        """Whether layer ``index`` is in the window (a layer not known yet always is)."""
        if index >= self.layers or self.full:
            return True
        return (index - self.offset) % self.layers < self.size

    def members(self) -> set[int] | None:
        """The layers in the window (``None``: all)."""
        if self.full:
            return None
        return {(self.offset + k) % self.layers for k in range(int(self.size))}


@dataclass(frozen=True)
class IterationPlan:
    """What the next iteration measures, and why (``reason``, for people and tests)."""

    index: int
    kind: Kind
    window: Window
    hooks: HookState
    passes: int
    reason: str

    @property
    def light(self) -> bool:
        return self.kind is Kind.LIGHT


# -- the account -------------------------------------------------------------------------
def credit_for(untracked: float, share: float | None, tuning: Tuning = DEFAULT) -> float:
    """Judging's credit for ``untracked`` seconds of the program's life before tracking."""
    rate = tuning.startup_share if share is None else min(tuning.startup_share, share)
    return rate * min(untracked, tuning.startup_credit)


def prices_after(account: Account, ended: Ended, tuning: Tuning = DEFAULT) -> Account:
    """The account's prices after ``ended``: a light iteration sets the light price; the
    dearest recent sampled one sets the sampled price (one dear iteration after cheap ones
    would otherwise overdraw the budget each time the bank refills), falling back by
    ``sampled_decay`` at each cheaper one; a sampled one that stopped half way says only
    that a whole one costs more, so it lowers nothing."""
    if ended.light:
        return replace(account, light_price=ended.own / ended.iterations)
    decay = 1.0 if ended.cut else tuning.sampled_decay
    return replace(account, sampled_price=max(ended.own, decay * account.sampled_price))


def shortfall(account: Account) -> float:
    """What the bank lacks to pay for a sampled iteration over a light one (0 or less: it
    can)."""
    return max(0.0, account.sampled_price - account.light_price) - account.bank


def is_first(iterations: int, tuning: Tuning = DEFAULT) -> bool:
    """Whether the iteration after ``iterations`` ended ones is one of the first."""
    return iterations < tuning.sampled_first


def next_kind(account: Account, tuning: Tuning = DEFAULT) -> tuple[Kind, str]:
    """Whether the next iteration is sampled or light, and why."""
    if account.share is None:
        return Kind.SAMPLED, "no budget (overhead=None): every iteration is sampled"
    if is_first(account.iterations, tuning):
        return Kind.SAMPLED, f"one of the first {tuning.sampled_first} iterations"
    short = shortfall(account)
    if short <= 0:
        return Kind.SAMPLED, "the account pays for a sampled iteration"
    return Kind.LIGHT, f"the account lacks {short * 1e3:.3f} ms for a sampled iteration"


def overdrawn(bank: float, *, first: bool, own: float, loop: float,
              tuning: Tuning = DEFAULT) -> bool:
    """Whether a sampled iteration has spent more than it may, ``own`` seconds of measuring
    in it after ``loop`` seconds of the loop's own: past the first iterations, when the bank
    is overdrawn (an episode far longer than the last one sampled); in the first ones, when
    measuring passed ``first_share`` of the loop's time and the floor. (Called at module
    calls: it takes the bank, not an :class:`Account`, so that none is made there.)"""
    if first:
        return own > tuning.floor and own > tuning.first_share * loop
    return bank < 0


# -- the window of layers ----------------------------------------------------------------
def next_window(window: Window, *, layers: int, ended: Ended, share: float | None,
                dispatched: float = 0.0, tuning: Tuning = DEFAULT) -> Window:
    """The window of the iteration after ``ended``, ``layers`` layers known now: sized so
    that measuring stays within ``share`` of the loop's time (at most doubling at once) and
    moved past the ended one's layers. ``dispatched``: what torch's dispatch to the hooks
    added (``own`` holds the hooks' clocked time; :mod:`memsentry.record.unseen`)."""
    kept = replace(window, layers=layers)
    if not judges_window(ended, layers=layers, share=share, tuning=tuning):
        return kept
    assert share is not None
    own = ended.own + dispatched
    allowed = max(share * max(ended.seconds - own, 1e-9), tuning.floor)
    if window.full and own <= allowed:
        return kept
    current = float(layers) if window.full else window.size
    size = math.floor(current * min(2.0, allowed / own if own > 0 else 2.0))
    if size >= layers:
        return Window(layers)
    offset = 0 if window.full else (window.offset + int(current)) % layers
    return Window(layers, max(1, size), offset)


def judges_window(ended: Ended, *, layers: int, share: float | None,
                  tuning: Tuning = DEFAULT) -> bool:
    """Whether what ``ended`` cost says anything of the window: not without a budget, not in
    the first iterations (measured in full), not without layers, and not when it was light
    (it measured nothing)."""
    if share is None or not layers or ended.light:
        return False
    return ended.index + 1 >= tuning.sampled_first


# -- boundaries passed with a count -------------------------------------------------------
def passes(account: Account, *, each: float, closing: float, running: int,
           census_pending: bool = False, tuning: Tuning = DEFAULT) -> int:
    """How many of the next boundaries only count, after a light iteration whose closing
    took ``closing`` seconds (``each``: the loop's seconds per iteration; ``running``: the
    iteration that began): as many as keep reading boundaries within ``read_share`` of the
    budget, no more than until a census falls due; none when the next one is sampled, or
    while a census is pending (a loop with no module call takes it at the next closing: a
    passed boundary would put it off, to the block's end at worst, under the wrong
    iteration)."""
    if account.share is None or census_pending or shortfall(account) <= 0:
        return 0
    earned = account.share * max(each, 1e-9)  # what an iteration pays into the account
    count = math.ceil(closing / (tuning.read_share * earned)) - 1
    count = min(count, tuning.max_passed, next_census(running - 1, tuning) - running)
    return max(0, count)


def length_stride(spent: float, account: Account, tuning: Tuning = DEFAULT) -> int:
    """Every how many boundaries passed with a count the lengths of the containers followed
    are read, after a reading that took ``spent`` seconds: as often as keeps the readings
    within ``length_share`` of the budget, an iteration paying in its share of the loop's
    mean seconds per iteration; every one without a limit or before an iteration was
    clocked."""
    if account.share is None or account.iterations <= 0 or account.loop <= 0:
        return 1
    earned = account.share * account.loop / account.iterations
    stride = math.ceil(spent / (tuning.length_share * earned))
    return max(1, min(stride, tuning.max_passed))


# -- hooks ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Signal:
    """What ends the loop's iterations, as the policy needs it: ``step`` an optimizer step or
    ``t.step()``; ``backward`` a backward pass, ``seen`` when the wrapped
    ``torch.autograd.backward`` sees each end; ``forward`` the first outermost module's next
    call."""

    step: bool = False
    backward: bool = False
    seen: bool = False
    forward: bool = False


def hook_state(kind: Kind, signal: Signal, *, census_pending: bool,
               forward_running: bool) -> HookState:
    """The hooks the next iteration keeps: a sampled one its window; a light one none when
    its end needs no module hook, no census waits for its first call and no forward runs;
    only the first outermost module when that module's calls end iterations; else the
    anchors."""
    if kind is Kind.SAMPLED:
        return HookState.WINDOW
    if ends_unhooked(signal) and not census_pending and not forward_running:
        return HookState.BARE
    if signal.forward:
        return HookState.LEAN
    return HookState.ANCHORS


def ends_unhooked(signal: Signal) -> bool:
    """Whether an iteration's end comes without a module hook: an optimizer step,
    ``t.step()``, or a backward pass whose end the wrapped function sees."""
    return signal.step or (signal.backward and signal.seen)


# -- censuses ------------------------------------------------------------------------------
def census_due(index: int, tuning: Tuning = DEFAULT) -> bool:
    """Censuses at iterations 2, 3, 4 (three points decide a trend within five iterations),
    then 6, 10, 18, 34, ...: doubling gaps, so a long run pays for a handful."""
    first = tuning.first_census
    if first <= index <= first + 2:
        return True
    gap = index - first
    return gap >= 4 and gap & (gap - 1) == 0


def next_census(index: int, tuning: Tuning = DEFAULT) -> int:
    """The first iteration after ``index`` with a census due."""
    following = index + 1
    while not census_due(following, tuning):
        gap = following - tuning.first_census
        following = tuning.first_census + (1 << gap.bit_length()) if gap >= 4 else following + 1
    return following


@dataclass(frozen=True)
class CensusState:
    """The censuses' side of the plan: ``wanted`` one is due and waits for the account;
    ``pending`` the iteration of the one to take as the next begins; ``free`` when the one
    wanted is taken whatever the account holds; ``deferred`` how many waited; ``last_cost``
    what the last one took; ``settles`` the iteration from which a census would confirm a
    leak found but not yet said while the run lives (:data:`memsentry.alarm.CONFIRM`)."""

    wanted: bool = False
    pending: int | None = None
    free: bool = False
    deferred: int = 0
    last_cost: float = DEFAULT.census_guess
    settles: int | None = None

    @property
    def reserved(self) -> float:
        """What measuring leaves in the account for a census that waits."""
        return self.last_cost if self.wanted else 0.0


def always_taken_through(tuning: Tuning = DEFAULT) -> int:
    """The iteration of the last census the schedule takes whatever the account holds (34)."""
    at = tuning.first_census - 1
    for _ in range(tuning.always_taken):
        at = next_census(at, tuning)
    return at


def affordable(state: CensusState, account: Account) -> bool:
    """A free census is taken when due; others when the account holds what the last one
    cost."""
    return state.free or account.held >= state.last_cost


def free_census(state: CensusState, index: int, *, scheduled: bool,
                tuning: Tuning = DEFAULT) -> bool:
    """Whether the census wanted at ``index`` is taken whatever the account holds: the
    schedule's first ``always_taken``, and the first from ``settles`` on, which would
    confirm a leak found but not yet said. Like the closing census, a verdict said while
    the run lives rests on it: a budget drained by the first seven would leave a leak that
    grows all run unsaid until the end. Its cost is charged to the account, which later
    censuses wait for; one per leak, as a leak said is not said again."""
    if scheduled and index <= always_taken_through(tuning):
        return True
    return state.settles is not None and index >= state.settles


def census_step(state: CensusState, account: Account, *, index: int, due: bool,
                scheduled: bool = False, tuning: Tuning = DEFAULT) -> CensusState:
    """At the boundary that closed iteration ``index``: a census is wanted when ``due``
    (``scheduled``: the schedule has one in the iterations that end there); it is pending
    (taken as the next iteration begins) when the account can pay for it or it is free
    (:func:`free_census`), else it waits, with the first claim on the account, for a
    boundary that can. One that waits (growth asked for it) becomes free when the schedule's
    census falls due behind it, or when it would confirm a leak."""
    if due or state.wanted:  # one waiting becomes free when the schedule's is, or it settles
        waiting = state.wanted
        state = replace(state, wanted=True, free=state.free or free_census(
            state, index, scheduled=scheduled, tuning=tuning))
        if not waiting and not affordable(state, account):
            state = replace(state, deferred=state.deferred + 1)
    if state.wanted and state.pending is None and affordable(state, account):
        state = replace(state, pending=index, wanted=False, free=False)
    return state


@dataclass(frozen=True)
class Standing:
    """What memory and hooks were as a census began, to tell whether a later one would find
    the same: its ``iteration``, ``allocated`` (the backend's figure, the censuses' records
    left out), ``heap`` (glibc's in-use count, the same way; ``None`` when the backend counts
    the heap itself or it cannot be read) and the user's hooks per module
    (:func:`~memsentry.census.hooks.hook_counts`)."""

    iteration: int
    allocated: int
    heap: int | None
    hooks: tuple[tuple[str | None, int], ...]


def stands(then: Standing | None, now: Standing, *, heap_backend: bool,
           tuning: Tuning = DEFAULT) -> bool:
    """Whether the census read at ``then`` still stands at ``now``, so that none need be
    taken: ``carry_gap`` iterations or more apart, no hook was added or removed, and memory
    moved no more than the heap's jitter (``still_bytes`` where the figure is the heap's,
    ``heap_backend`` for the backend's; none where it counts tensors). A tensor kept or
    dropped since moves them further: every tensor is a C allocation of its ``TensorImpl``
    whatever its device."""
    if then is None or now.iteration - then.iteration < tuning.carry_gap \
            or now.hooks != then.hooks:
        return False
    slack = tuning.still_bytes
    if abs(now.allocated - then.allocated) > (slack if heap_backend else 0):
        return False
    if now.heap is None or then.heap is None:
        return now.heap is None and then.heap is None
    return abs(now.heap - then.heap) <= slack


def closing_census(last: int | None, end: int, *, rising: bool,
                   tuning: Tuning = DEFAULT) -> bool:
    """Whether a census is wanted as tracking ends, judged as of ``end`` (the last iteration
    closed): when a holder still grew at the ``last`` census taken and ``carry_gap``
    iterations or more ran since. Censuses at doubling gaps can stop half a run before its
    end (the last of 60 iterations at 34); a container that fills to a size and then stays
    grows like a leak until it is full, and judged on those censuses alone it was called one.
    Where nothing grew at the last census no verdict of growth rests on it, and none is
    wanted. Like the first ``always_taken`` it is taken whatever the account holds: a
    verdict rests on it, and the account those drained would make it hang on the load."""
    return last is not None and rising and end - last >= tuning.carry_gap


def census_in(index: int, iterations: int, tuning: Tuning = DEFAULT) -> bool:
    """Whether the schedule has a census in the ``iterations`` that end at ``index``."""
    return next_census(index - iterations, tuning) <= index


# -- the plan ------------------------------------------------------------------------------
def plan_next(account: Account, window: Window, signal: Signal, *, index: int,
              census_pending: bool, forward_running: bool,
              tuning: Tuning = DEFAULT) -> IterationPlan:
    """The plan of iteration ``index``, about to begin, from the account after the last
    boundary, the window set for it and the loop's iteration signal. (How many boundaries
    it passes with a count is set apart, :func:`passes`, once a light closing was
    clocked.)"""
    kind, reason = next_kind(account, tuning)
    hooks = hook_state(kind, signal, census_pending=census_pending,
                       forward_running=forward_running)
    return IterationPlan(index=index, kind=kind, window=window, hooks=hooks, passes=0,
                         reason=reason)

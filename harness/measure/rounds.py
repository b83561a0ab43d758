"""Timing in rounds: every timed point is repeated in short repetitions spread over the sweep,
interleaved with the other ways at its shape and with nn.MultiheadAttention timed alongside.

Why: on a shared machine speed drifts by 10-25% over minutes while each 1-2 s window looks
quiet. Timing a point once, in one window, gives a figure that a re-run does not reproduce and a
noise estimate ~20x too small. Here (docs/architecture.md, "Measurement you can act on"):

- A point's Hydra job builds, checks, warms up and probes its point, then hands a ``Session``
  (its timed callable, ready to run: harness/measure/session.py) to the process's ``Pool`` and
  returns.
- The pool runs ``timing.rounds`` rounds. In round r it visits every shape in a shuffled order
  and, at each shape, every way in a shuffled order (nn.MultiheadAttention among them), timing
  each for one repetition of about ``timing.round_time`` seconds (the median of its calls).
  Round r+1 starts only after round r has visited every shape, so each point's repetitions span
  the whole timing phase and their spread sees the machine's drift.
- The speedup of a way is computed per round against nn.MultiheadAttention timed a fraction of
  a second before or after it (paired), which cancels the drift both saw.
- Where the pool lives: in the worker process that runs the points (harness/sweep/serve.py). With
  Hydra's basic launcher every job runs in the sweeper's process and so uses one worker: its
  pool collects every point and the sweeper asks for the rounds after the last job (earlier, at
  a shape boundary, when the waiting points would hold more memory than ``timing.resident_mb``:
  each such part is a block, rounds spread over the block). Jobs that run in other processes
  (joblib, submitit, SLURM), a single run and ``run_point`` time their point in a pool of their
  own: the same rounds, back to back, paired with a reference of their own. Their intervals see
  only their own few seconds.
- A shape whose reference is not among the sweep's points (``sweep=toggles``, say) gets one
  built for pairing (nn.MultiheadAttention in the point's dtype on the same inputs, no row).
- Every repetition goes to the journal as it ends (``harness/measure/journal.py``). A resumed
  sweep's points arrive with the repetitions they had; only the rounds they lack run, and a
  pair is always two repetitions of the same round of the same run (``run_rounds``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import time
from typing import Callable

import torch

from harness.config import Point, VariantSpec
from harness import envinfo
from harness.measure import contention, stats
from harness.errors import BrokenDevice, BusyStop, one_line
from harness.way.inputs import make_inputs, make_reference
from harness.way.footprint import footprint, handed_elements, scores_of
from harness.measure.journal import new_run_id
from harness.way.recheck import timed_call
from harness.measure.memory import held_bytes, release_memory
from harness.measure.figures import timed
from harness.measure.session import Session, is_reference
from harness.measure.timing import GraphMemory, flush_bytes

# What callers import from here, the session's names among them (harness/measure/session.py).
__all__ = [
    "Pool",
    "Session",
    "budget_bytes",
    "is_reference",
    "reference_key",
    "reference_session",
    "run_rounds",
]


def reference_key(point: Point) -> str:
    """The journal's key for nn.MultiheadAttention built for pairing at ``point``'s shape: the same
    in every run of the sweep, so that a resumed sweep finds its repetitions."""
    return "reference@" + hashlib.sha1(repr(point.shape_key()).encode()).hexdigest()[:16]


def reference_session(point: Point) -> Session:
    """nn.MultiheadAttention at ``point``'s shape, dtype and inputs, ready to be timed, for a
    shape whose reference is not among the points."""
    grad = point.mode == "fwd_bwd"
    model = make_reference(point).to(point.device, point.torch_dtype)
    inputs = make_inputs(point).to(point.device, point.torch_dtype, grad)
    ref_point = dataclasses.replace(point, compile="off", sdpa_backend="auto")
    call, before = timed_call(model, model, inputs, point.mode)
    session = Session(
        ref_point, call, before, held_bytes(model, inputs, grad), finish=None, reference=True
    ).prepare()
    session.capture()  # a pool of its own: it joins a block already captured
    return session


def threads_said(sessions: list[Session]) -> str:
    """ " with num_threads=1 of 2 cores (...)" for the CPU points (envinfo.threads_said); empty on
    a GPU."""
    threads = sorted(
        {s.point.num_threads for s in sessions if not s.point.device.startswith("cuda")}
    )
    said = envinfo.threads_said(threads, envinfo.available_cores())
    return f" with {said}" if said else ""


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def _pairing_reference(members: list[Session], say: Callable[[str], None]) -> Session | None:
    """The shape's nn.MultiheadAttention: a point of the sweep, or one built for pairing (which
    journals next to the first member and takes its repetitions from an earlier run)."""
    ref = next((s for s in members if s.reference), None)
    if ref is not None:
        return ref
    try:
        ref = reference_session(members[0].point)
    except Exception as e:  # no reference: the rows have no speedup, and say why
        say(
            "rounds: no nn.MultiheadAttention to pair with at "
            f"{members[0].point.variant.name}'s shape ({one_line(e)}); its rows get no speedup"
        )
        return None
    ref.journal, ref.journal_key = members[0].journal, reference_key(members[0].point)
    if ref.journal is not None:
        ref.samples = ref.journal.load(ref.journal_key)
    members.append(ref)
    return ref


def run_rounds(
    sessions: list[Session],
    say: Callable[[str], None] = print,
    on_visit: Callable[[Session, int], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> None:
    """Time ``sessions`` in interleaved rounds, then hand each its columns (``Session.finish``).

    Sessions may arrive with repetitions from an earlier run of the sweep (resume): a way's are
    kept where its reference has the same round of the same run (its pair), and only the rounds
    a point lacks run, its reference beside it. ``on_visit(session, round)`` is called before
    each repetition (the worker tells its job process whose call is running); ``stop()`` true
    between two repetitions ends the rounds as Ctrl-C does: points with two rounds or more get
    a row marked partial, the others keep the row they have (timing pending)."""
    run = new_run_id()
    groups: dict = {}
    for s in sessions:
        groups.setdefault(s.key, []).append(s)
    references: dict = {}
    for key, members in groups.items():
        ref = references[key] = _pairing_reference(members, say)
        if ref is not None:
            theirs = {(s.run, s.round) for s in ref.samples}
            for s in members:
                if s is not ref:
                    s.samples = [x for x in s.samples if (x.run, x.round) in theirs]
    total = max(s.point.timing.rounds for s in sessions)
    # after them, rounds that re-time the repetitions contention spoiled (Session.needs)
    extra = max(s.point.timing.retime_rounds for s in sessions)
    n_points = sum(1 for s in sessions if s.finish is not None)
    resumed = [s for s in sessions if s.finish is not None and s.samples]
    start = time.perf_counter()
    say(
        f"rounds: timing {n_points} points at {len(groups)} shapes in {total} interleaved rounds"
        + threads_said(sessions)
        + (
            ", timed by their thread's CPU time (a busy machine's waits are not in it)"
            if any(s.timed_by == "cpu" for s in sessions)
            else ""
        )
        + (
            f"; {len(resumed)} resume with {sum(len(s.by_round()) for s in resumed)} repetitions "
            "from an earlier run"
            if resumed
            else ""
        )
    )
    interrupted = True
    broken = False
    try:
        busy_streak = 0  # re-timing rounds in a row that contention spoiled half or more of
        warned = False  # busy_now said
        for r in range(total + extra):
            rng = random.Random(r)  # a fresh order each round, the same in every run
            keys = list(groups)
            rng.shuffle(keys)
            ran = spoiled = 0
            pairs = clean_pairs(groups, references)
            for key in keys:
                ref = references[key]
                members = [s for s in groups[key] if s is not ref and s.needs(r, ref)]
                if (
                    ref is not None
                    and ref.failure is None
                    and (members or (ref.finish is not None and ref.needs(r)))
                ):
                    members.append(ref)
                rng.shuffle(members)
                for s in members:
                    if stop is not None and stop():
                        raise KeyboardInterrupt
                    if on_visit is not None:
                        on_visit(s, r)
                    s.repeat(r, run)
                    ran += 1
                    spoiled += bool(
                        s.samples and s.samples[-1].round == r and s.samples[-1].contended
                    )
            elapsed = time.perf_counter() - start
            if r < total and ran:
                say(
                    f"round {r + 1}/{total} done: {_clock(elapsed)} elapsed, "
                    f"~{_clock(elapsed / (r + 1) * (total - r - 1))} left"
                    + (
                        f" ({spoiled} of {ran} repetitions spoiled by contention)"
                        if spoiled
                        else ""
                    )
                )
                if not warned and 2 * spoiled >= ran and spoiled:
                    warned = True  # once: at the first round the machine spoiled half of
                    stopping = any(s.point.timing.when_busy == "stop" for s in sessions)
                    say(busy_now(sessions, r, spoiled, ran, stopping))
                    if stopping:  # as Ctrl-C: the points keep their checks, resume times them
                        raise BusyStop()
            elif ran:
                say(
                    f"re-timing round {r + 1 - total}: {ran} repetitions after contention spoiled "
                    f"theirs, {spoiled} spoiled again ({_clock(elapsed)} elapsed)"
                )
            if r >= total:
                # Nothing left to re-time, or the machine is still busy (half the repetitions
                # spoiled again, or no point gained a clean pair: a reference spoiled in every
                # round spoils its ways' pairs): more rounds would only repeat what the spoiled
                # ones measured.
                busy = 2 * spoiled >= ran or clean_pairs(groups, references) == pairs
                busy_streak = busy_streak + 1 if ran and busy else 0
                if not ran or busy_streak >= RETIME_GIVE_UP:
                    break
        interrupted = False
        said = contention_said(sessions)
        if said:
            say(said)
        for s in sessions:  # before the leak flag accuses, a second measurement
            if s.finish is not None and s.failure is None and s.grew_steadily():
                s.confirm_leak()
    except BrokenDevice:
        broken = True  # only the failed get rows: the rest are timed again in a fresh process
        raise
    finally:  # Ctrl-C included: points with two rounds or more get them (with fewer: no interval)
        for key, members in groups.items():
            ref = references[key]
            floor = measured_floor(members, ref)
            for s in members:
                if s.finish is None or not (
                    s.failure
                    or (not broken and s.samples and not interrupted)
                    or (not broken and len(s.by_round()) >= 2)
                ):
                    continue
                if not broken:
                    s.run_recheck()
                paired = ref if ref is not None and ref.failure is None else None
                s.finish(timed(s, paired, floor), s.failure)


def busy_now(
    sessions: list[Session], r: int, spoiled: int, ran: int, stopping: bool = False
) -> str:
    """The line said at the first round that contention spoiled half of: what it means and what
    to do, at once, not when the rounds end (a busy 2-core VM took 24 minutes to say it)."""
    threads = sorted(
        {s.point.num_threads for s in sessions if s.timed_by == "wall" and s.failure is None}
    )
    hint = (
        f"; num_threads=1 would time them by their thread's CPU time, which a busy machine's "
        f"waits do not reach (these run {'/'.join(map(str, threads))} threads)"
        if threads
        else ""
    )
    return (
        f"rounds: the machine is busy: contention spoiled {spoiled} of {ran} repetitions in round "
        f"{r + 1}; while it stays so, the points will stay contended and decide nothing"
        + (
            "; timing.when_busy=stop: the sweep stops here (exit 3), resume=true times them "
            "later"
            if stopping
            else f"{hint}. Ctrl-C stops the rounds now (rows kept), resume=true finishes them "
            "later; timing.when_busy=stop stops a sweep here by itself"
        )
    )


def clean_pairs(groups: dict, references: dict) -> int:
    """How many clean rounds the shapes' points have, each paired with a clean round of its
    reference (``Session.clean``): what a re-timing round is for."""
    return sum(len(s.clean(references[key])) for key, members in groups.items() for s in members)


def measured_floor(members: list[Session], ref: Session | None) -> float | None:
    """The shape's between-run floor measured from its clean rounds (``stats.drift_floor``), used
    to widen the earned one where ``timing.rerun_noise`` is null: over each way's per-round ratio
    to nn.MHA (what its speedup interval is built from: drift both saw cancels there too), or
    over the points' times where the shape has no reference. None when too few rounds ran."""
    ways = [s for s in members if s.failure is None and s is not ref]
    if ref is not None and ref.failure is None and ways:
        # every run's rounds (a resumed point pairs with the reference's round of its own run)
        field = ref.method()[1]  # the clock that decides (the CPU time with one thread)
        theirs = {(x.run, x.round): getattr(x, field) for x in ref.samples if not x.contended}
        series = [
            [theirs[(x.run, x.round)] / getattr(x, field) for x in s.clean(ref)]
            for s in ways
            if s.method()[1] == field
        ]
    else:
        series = [
            [getattr(x, s.method()[1]) for x in s.clean()] for s in members if s.failure is None
        ]
    return stats.drift_floor(series)


# Re-timing rounds in a row in which half the repetitions or more were spoiled again: the machine
# is still busy, and the rounds end (the points short of clean rounds say so: ``contended``). (A
# main job beside two busy processes at two threads spoiled 80-100% of every re-timing round: with
# "every repetition" as the rule it ran all 11 of them, doubling its timing for nothing.)
RETIME_GIVE_UP = 2


def contention_said(sessions: list[Session]) -> str:
    """The rounds' contention in one line ("" when no repetition was spoiled)."""
    seen = [x for s in sessions for x in s.seen]
    spoiled = [x for s in sessions for x, why in zip(s.seen, s.spoiled) if why]
    reasons = [why for s in sessions for why in s.spoiled if why]
    if not spoiled:
        return ""
    cores = envinfo.available_cores()
    references = {s.key: s for s in sessions if s.reference}
    left = sum(
        1
        for s in sessions
        if s.finish is not None and s.failure is None and s.stayed_contended(references.get(s.key))
    )
    return (
        f"rounds: contention spoiled {len(spoiled)} of {len(seen)} repetitions "
        f"({contention.words(spoiled, cores, reasons)}); "
        + (
            f"{left} point{'s' if left > 1 else ''} stayed contended after re-timing: "
            f"{'their' if left > 1 else 'its'} figures decide nothing"
            if left
            else "each was re-timed in a clean round"
        )
    )


class Pool:
    """Points waiting for their rounds, in arrival order. ``run`` times them and empties it.
    ``say``, ``on_visit`` and ``stop`` are passed to ``run_rounds``."""

    def __init__(self, say: Callable[[str], None] = print, on_visit=None, stop=None):
        self.sessions: list[Session] = []
        self.held = 0
        # a shape's nn.MultiheadAttention the rounds will build to pair with (``pairing_bytes``)
        # where no waiting point is it: shape key -> its bytes, counted with ``held``
        self.pairing: dict = {}
        self.say, self.on_visit, self.stop = say, on_visit, stop
        self.memory = GraphMemory()  # the block's CUDA graphs share one pool (GraphMemory)
        # why the worker should be replaced once nothing waits in it (None: it need not be): a
        # capture failed into a block's pool, which this torch may never free
        self.replace: str | None = None

    def add(self, session: Session) -> None:
        """Queue a point, and on CUDA capture its call in the block's graph pool. At a new shape,
        when the waiting points and this one with its graph (measured before the capture:
        ``Session.graph_bytes``) hold more than the budget, time the waiting points first (a
        block): memory stays bounded while shapes keep their rounds."""
        new_shape = bool(self.sessions) and session.key != self.sessions[-1].key
        pairing = self._pairing_at(session)
        need = session.nbytes + session.graph_bytes() + pairing
        if new_shape and self._holding() + need > budget_bytes(session.point):
            self.run()
            pairing = self._pairing_at(session)  # the block's count starts again
        try:
            session.capture(self.memory)
        except BrokenDevice as e:  # its own capture: its failure, not the waiting points'
            session.failure = ("error", f"{e} (its CUDA graph capture)", "")
            raise
        self.sessions.append(session)
        self.held += session.nbytes
        if session.reference:  # the shape's own: none is built for it
            self.pairing[session.key] = 0
        else:
            self.pairing.setdefault(session.key, pairing)

    def _holding(self) -> int:
        """Bytes the waiting points hold, with the references the rounds will build for them."""
        return self.held + sum(self.pairing.values())

    def _pairing_at(self, session: Session) -> int:
        """What pairing ``session``'s shape adds, where the block has nothing of that shape yet
        (``pairing_bytes``; none for nn.MHA itself)."""
        if session.reference or session.key in self.pairing:
            return 0
        return pairing_bytes(session.point)

    def make_room(self, point: Point) -> None:
        """Before ``point`` is prepared (checked, warmed up, its CUDA graph captured): at a new
        shape, when the waiting points and what this one will hold (``expected_bytes``) pass the
        budget, time the waiting points first. ``add``'s check comes after the capture, when the
        graph's pool is already allocated (a shape's graphs can fill a GPU: issue 56), and a
        point checked while others' graphs wait can find too little free memory (a false oom)."""
        if self.sessions and point.shape_key() != self.sessions[-1].key:
            pairing = 0 if is_reference(point) else pairing_bytes(point)
            if self._holding() + expected_bytes(point) + pairing > budget_bytes(point):
                self.run()

    def run(self) -> None:
        sessions, self.sessions, self.held, self.pairing = self.sessions, [], 0, {}
        memory, self.memory = self.memory, GraphMemory()  # this block's goes with its graphs
        if memory.failed:
            self.replace = (
                f"a CUDA graph capture failed in this worker ({memory.failed}); its pool may "
                "never be freed on this torch (pytorch#190348), so the worker is replaced"
            )
        if not sessions:
            return
        try:
            run_rounds(sessions, self.say, self.on_visit, self.stop)
        finally:  # rows written (or the rounds stopped): the block's graphs and pool go now
            for s in sessions:
                s.release()
            release_memory(sessions[0].point.device)


def expected_bytes(point: Point) -> int:
    """What a point will hold while it waits for its rounds, before it is built: the variant's
    footprint (inputs, weights, activations: harness/way/footprint.py), and again on CUDA
    when its call is captured in a CUDA graph, whose private pool keeps every tensor the call
    allocates (``Session.capture`` measures it after the capture)."""
    item = torch.empty(0, dtype=point.torch_dtype).element_size()
    try:
        scores = scores_of(point)  # its kernel's declaration: imports the variant
    except Exception:  # noqa: BLE001 (a variant that cannot be imported: its own check says so)
        scores = point.need_weights
    own = footprint(point, scores).bytes(item, point.mode)
    if is_reference(point):  # nn.MHA holds a model feature's float mask in its call
        own += item * handed_elements(point)
    graph = point.device.startswith("cuda") and point.timing.cuda_graph
    return own * (2 if graph else 1)


def pairing_bytes(point: Point) -> int:
    """What the nn.MultiheadAttention built to pair ``point``'s shape holds while its block is
    timed (``reference_session``, where none of the sweep's points is it: ``sweep=toggles``),
    with its graph's pool on CUDA: a block's budget counts it before the block is filled (issue
    71, D10: it was built, and captured, outside every block's count)."""
    nn_mha = VariantSpec("reference", "variants.reference.ReferenceMHA")
    return expected_bytes(dataclasses.replace(point, variant=nn_mha, compile="off",
                                              sdpa_backend="auto"))  # fmt: skip


def budget_bytes(point: Point) -> float:
    """``timing.resident_mb``, or a quarter of the device's memory (the rest is for the calls)."""
    if point.timing.resident_mb is not None:
        return point.timing.resident_mb * 2**20
    if point.device.startswith("cuda"):
        total = torch.cuda.get_device_properties(point.device).total_memory
        # the process's one L2-flush buffer waits with the points (timing.flush_buffer)
        return total / 4 - (flush_bytes(point.device) if point.timing.flush_l2 else 0)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 4
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30

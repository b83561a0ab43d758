"""Run one sweep point: build, check (harness/way/check.py), probe, then time it in rounds.
Never writes files.

A point's result is a ``Record`` (harness/schema.py): each stage returns its typed part (the
identity when admitted, the check's parts, the probe and profile, the timing and throughput) and
the record settles each stage's verdict (harness/outcome.py's rule). ``prepare_point`` does
everything but the timing and returns the record with a ``Session``: the rounds
(``harness/measure/rounds.py``) time the session among the sweep's other points and complete the
record. ``run_point`` is both in one call, for a single point, and returns its columns.

A failure inside the point becomes the record's outcome (oom, unsupported, error); only
``InvalidPoint`` escapes, because the caller decides what a bad value means (a single run exits
non-zero, a sweep records ``invalid`` and goes on).
"""

from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass
import logging
import os
from pathlib import Path
from typing import Callable

import torch

from harness import features
from harness.declarations import DECLARATION_KEYS
from harness.way import capabilities
from harness.way.build import built
from harness.way.capabilities import provenance
from harness.way.recheck import Counted, Recheck, output_of, timed_call
from harness.config import IDENTITY_KEYS, InvalidPoint, Point, VariantSpec
from harness.envinfo import env_columns, use_device
from harness.errors import (
    BrokenDevice,
    Unsupported,
    after_check,
    classify,
    one_line,
    traceback_of,
)
from harness.way.calls import sdpa_context
from harness.way.inputs import make_inputs, make_reference
from harness.way.compiling import compiled_graphs, cudagraph_skips, probe_compile
from harness.flops import decode_bytes, gbps, mha_flops, tflops
from harness.measure.journal import Journal
from harness.measure.memory import held_bytes, reachable_bytes, release_memory
from harness.measure.profiling import probe_point, profile_point
from harness.measure.figures import Timed
from harness.measure.roofline import FixedPeak, PeakBook, book, datasheet_peak, device_sms
from harness.measure.rounds import Pool, Session, is_reference
from harness.outcome import Verdict
from harness.way.check import Checked, build_and_check, check_status, kept_check
from harness.way.yardsticks import Shelf
from harness.progress import case
from harness.results import TRACEBACK
from harness.schema import Environment, Identity, Probe, Profile, Record, Throughput, computed

__all__ = [
    "admit",
    "base_record",
    "build_and_check",
    "complete",
    "identity_of",
    "invalid_row",
    "kept_check",
    "prepare_point",
    "probe_point",
    "profile_point",
    "ready_to_time",
    "run_point",
    "Shelf",
    "timing_setup",
    "check_status",
]

log = logging.getLogger("harness")


def identity_of(point: Point, fixed: str = "") -> Identity:
    """What was asked, before anything ran: the variant, the point's shape, way and machine keys
    (config.ROLES: each a column of every row) and the work one call does."""
    flops, nbytes = work(point)
    return Identity(
        variant=point.variant.name,
        variant_options=point.variant.options_str,
        label=point.variant.label,
        **provenance(point.variant.target),
        fixed=fixed,
        **{k: getattr(point, k) for k in IDENTITY_KEYS if k not in ("variant", "kv_cache")},
        head_dim=point.head_dim,
        kv_cache=point.kv_cache if point.kv_cache_len is not None else "",  # empty: no decode
        flops=flops,
        bytes_per_call=nbytes,
    )


def work(point: Point) -> tuple[float, float | None]:
    """One call's FLOPs and a decode step's least bytes (None off decode): a feature's own work
    model where it has one (latent attention's low-rank projections and latent cache), else nn.MHA's
    dense one (harness/flops.py)."""
    own = features.work(point)
    if own is not None:
        return own
    flops = mha_flops(
        point.batch,
        point.seq_len,
        point.kv_seq_len,
        point.embed_dim,
        point.hides_later_keys,
        point.mode,
        point.num_kv_heads / point.num_heads,
        point.kv_cache_len or 0,
        point.window,
    )
    if point.kv_cache_len is None:
        return flops, None
    itemsize = torch.empty(0, dtype=point.torch_dtype).element_size()
    kv_frac = point.num_kv_heads / point.num_heads
    bias = point.bias is not False
    return flops, decode_bytes(
        point.batch, point.seq_len, point.kv_cache_len, point.embed_dim, kv_frac, bias, itemsize
    )


def base_record(point: Point, fixed: str = "") -> Record:
    """The point's record before anything ran: its identity and where it runs."""
    return Record(identity_of(point, fixed), Environment(**env_columns(point.device)))


def timing_setup(point: Point):
    """The point's timed callable and its untimed per-sample preparation, without the check:
    for tools that time the harness's exact call with another timer (validate_timer, bench)."""
    point, _, unsupported, _, cls = capabilities.apply(point)
    if unsupported:
        raise Unsupported(unsupported)
    variant = built(point, make_reference(point), cls)
    inputs = make_inputs(point).to(point.device, point.torch_dtype, point.mode == "fwd_bwd")
    return timed_call(variant.model, variant.fn, inputs, point.mode)


def admit(point: Point) -> tuple[capabilities.Admitted, Record]:
    """Before anything is built: the point the variant runs (its declarations applied), why it
    cannot run here (or None) and its kernel; and its record."""
    admitted = capabilities.apply(point)
    point, unsupported = admitted.point, admitted.refused
    if not unsupported and point.device.startswith("cuda") and not torch.cuda.is_available():
        unsupported = f"device={point.device!r} but CUDA is not available"
    index = torch.device(point.device).index
    if not unsupported and index is not None and index >= torch.cuda.device_count():
        unsupported = (
            f"device={point.device!r} but torch sees {torch.cuda.device_count()} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    return admitted._replace(refused=unsupported), base_record(point, admitted.fixed)


@dataclass(frozen=True)
class Bench:
    """Where a point is timed beside the others: the peaks its throughput is set against
    (harness/measure/roofline.py), where its profiling trace goes (``trace_root/<name>/``, its
    job number in the name) and its journal (a journal and this point's key in it), which
    records each repetition as it ends."""

    peaks: PeakBook = dataclasses.field(default_factory=FixedPeak)
    trace_root: Path | None = None
    job_num: int | None = None
    journal: tuple[Journal, str] | None = None


@dataclass(frozen=True)
class Warmed:
    """A checked point ready for its rounds (``ready_to_time``): its ``Session``, and what its
    record takes from the warm-up."""

    session: Session
    probe: Probe | None  # the probe's part (None: kept from an earlier run)
    profile: Profile | None  # the profiling pass's (None: not asked for, or kept)
    graph_skipped: bool  # inductor skipped CUDA graphs at a warm-up call


def ready_to_time(point: Point, record: Record, checked: Checked, bench: Bench) -> Warmed:
    """Warm the checked call up and choose its calls per repetition (a ``Session``), probe and
    profile it (unless kept), and give it its journal: the repetitions a resumed point had.
    Every call of the variant here runs under the point's SDPA pin: the first call's output
    where the check was kept (resume), the warm-up (``Session.prepare``), the probe and the
    profiling pass. ``record``, as checked, is read, not changed."""
    bench.peaks.get(point)  # measured now, before any point is timed, once per device and dtype
    if point.kv_cache_len is not None:
        bench.peaks.bandwidth(point)  # decode: the copy bandwidth, once per device
    model, fn, kept, recheck = checked.model, checked.fn, checked.kept, checked.recheck
    # a compiled call that replays CUDA graphs is probed as the same compile without them
    unrolled = None if kept is not None else probe_compile(model, point.compile, point.device)
    grad = point.mode == "fwd_bwd"
    inputs = checked.inputs64.to(point.device, point.torch_dtype, grad)
    probe = profile = None
    with sdpa_context(point.sdpa_backend):
        call, before = timed_call(model, fn, inputs, point.mode)
        probed = None if unrolled is None else timed_call(model, unrolled, inputs, point.mode)[0]
        if recheck is None:  # resume: the kept check stands for the first call, compared later
            if before:
                before()
            recheck = Recheck(output_of(call()), record.check.tolerance or 0.0, point.device)
        call = Counted(call)
        if probed is None:
            probed = call
        else:
            if before:
                before()
            probed()  # its compile: not a recompile of the timed call (counted below)
        graphs, skips = compiled_graphs(), cudagraph_skips()
        session = Session(
            point,
            call,
            before,
            # the checked output waits with the point for the re-check
            held_bytes(model, inputs, grad)
            + recheck.expected.numel() * recheck.expected.element_size(),
            finish=None,
            reference=is_reference(point),
            recheck=recheck,
        ).prepare()
        # after the warm-up, what the timed call holds (a handed or cached mask, the cache): the
        # estimate above counts the inputs before they are made for the module
        expected = recheck.expected.numel() * recheck.expected.element_size()
        session.nbytes = max(session.nbytes, reachable_bytes(call, before) + expected)
        skipped = cudagraph_skips() > skips  # at a warm-up call (a mutation seen at run time)
        if kept is None:
            probe = probe_point(point, model, probed, before)
            if point.profile and bench.trace_root is not None:
                profile = profile_point(
                    point, record.identity, call, before, bench.trace_root, bench.job_num
                )
            session.recompiles = compiled_graphs() - graphs  # steady state compiles nothing
    if bench.journal is not None:
        session.journal, session.journal_key = bench.journal
        if kept is None:
            # an earlier run's repetitions are not this one's
            session.journal.reset(session.journal_key)
        else:
            session.samples = session.journal.load(session.journal_key)
    return Warmed(session, probe, profile, skipped)


def prepare_point(
    point: Point,
    peaks: PeakBook | float | None = None,
    trace_root: Path | None = None,
    job_num: int | None = None,
    done: Callable[[Record], None] | None = None,
    journal: tuple[Journal, str] | None = None,
    prior: dict | None = None,
    shelf: Shelf | None = None,
) -> tuple[Record, Session | None]:
    """Build, check and (unless check_only) warm up, probe and profile one point.

    Returns its record and, for a point to be timed, its ``Session``: after its rounds the
    session completes the record (timing, throughput, outcome) and hands it to ``done``. With
    no session the record is complete as returned. ``peaks`` (the sweep's ``PeakBook``, or a
    fixed peak in TFLOP/s), ``trace_root``, ``job_num`` and ``journal``: its ``Bench``.
    ``prior`` is this point's row from an earlier run (resume): where its check still stands
    (``kept_check``) it is not redone, nor the probe and profile, and the journal's repetitions
    of the point are kept, so that only its missing rounds run. ``shelf`` holds the last shape's
    yardsticks for a caller that runs points one after another (None: the point's own)."""
    bench = Bench(book(peaks), trace_root, job_num, journal)
    admitted, record = admit(point)
    point = admitted.point
    if admitted.refused:
        return record.settle(Verdict("unsupported", admitted.refused)), None
    torch.set_num_threads(point.num_threads)
    use_device(point.device)

    passed = False  # the check passed: a later failure is a later call's

    def stages() -> Session | None:  # its tensors die with its frame
        nonlocal passed
        checked = build_and_check(admitted, record, prior, shelf)
        if point.check_only:
            return None
        passed = record.status == "ok"
        warmed = ready_to_time(point, record, checked, bench)
        if warmed.graph_skipped and record.check.cuda_graphs:
            record.check = dataclasses.replace(record.check, cuda_graphs=False)
        record.probe = warmed.probe or record.probe
        record.profile = warmed.profile or record.profile
        return warmed.session

    failed = False
    try:
        session = stages()
    except InvalidPoint:
        raise  # the caller's to decide (see module doc)
    # one bad point must not end the sweep: record it and go on
    except (Exception, SystemExit, KeyboardInterrupt) as e:
        if isinstance(e, KeyboardInterrupt) and not _own_stop(e):
            raise  # Ctrl-C or SIGTERM: the run's to handle
        said = after_check(e, "a call after the check passed") if passed else one_line(e)
        if isinstance(e, KeyboardInterrupt):
            said += " raised by the point's own code (no Ctrl-C reaches the worker running it)"
        record.settle(Verdict(classify(e), said))
        record.traceback = traceback_of(e)
        session, failed = None, True
    if failed:
        # The failed point's tensors are freed only now: inside the except block its traceback
        # still held them, so an empty_cache there kept them and the next point could be `oom`.
        release_memory(point.device)
    if session is None:
        return record, None
    session.finish = lambda timed, failure: (done or (lambda r: None))(
        complete(point, record, bench.peaks, timed, failure)
    )
    return record, session


def _own_stop(e: KeyboardInterrupt) -> bool:
    """A KeyboardInterrupt the point raised itself: where the process ignores Ctrl-C (a sweep's
    worker: harness/sweep/serve.py), no signal raised it, so the variant's code did; it is the
    point's error, not a stop of the run (it read "crashed: killed by SIGINT")."""
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def complete(
    point: Point,
    record: Record,
    peaks: PeakBook,
    timed: Timed | None,
    failure: tuple[str, str, str] | None,
) -> Record:
    """The record once its rounds are over: its timing and contention parts, its throughput and %
    of peak (a re-check that found the timed output changed makes it a mismatch); or the failure
    that ended its rounds (its timing is then left out)."""
    if failure is not None:
        record.traceback = failure[2]
        return record.settle(Verdict(failure[0], failure[1]))
    if timed.changed:
        record.settle(Verdict("mismatch", timed.changed))
    record.timing, record.contention = timed.timing, timed.contention
    record.throughput = throughput(point, record, peaks)
    return record


def throughput(point: Point, record: Record, peaks: PeakBook) -> Throughput | None:
    """TFLOP/s and % of peak of the timed latency; at decode, GB/s and % of copy bandwidth."""
    latency = record.timing.latency and record.timing.latency.center
    if not latency or latency != latency:
        return None
    identity = record.identity
    achieved = tflops(identity.flops, latency)
    peak = peaks.get(point)
    if peak and achieved > peak:
        where = case(identity.columns())
        peak = peaks.beaten(point, achieved, f"{point.variant.label} at {where}")
    sheet = datasheet_peak(record.environment.device_name, point.dtype, device_sms(point.device))
    part = Throughput(
        tflops=achieved,
        peak_tflops=peak,
        pct_of_peak=100 * achieved / peak if peak else None,
        peak_tflops_datasheet=sheet,
        pct_of_datasheet_peak=100 * achieved / sheet if sheet else None,
    )
    if identity.bytes_per_call:  # decode: bound by memory bandwidth, not FLOPs
        rate = gbps(identity.bytes_per_call, latency)
        copy = peaks.bandwidth(point)
        part = dataclasses.replace(
            part, gbps=rate, copy_gbps=copy, pct_of_copy_bw=100 * rate / copy if copy else None
        )
    return part


def run_point(
    point: Point,
    peak_tflops: PeakBook | float | None = None,
    trace_root: Path | None = None,
    job_num: int | None = None,
) -> dict:
    """Check, probe and time one point (its rounds paired with nn.MultiheadAttention at the same
    shape, back to back); return its complete row, computed columns included, and a failure's
    traceback under ``TRACEBACK`` (not a column: ``write_row`` puts it beside the row)."""
    record, session = prepare_point(point, peak_tflops, trace_root, job_num)
    if session is not None:
        pool = Pool(say=log.debug)
        try:
            pool.add(session)
        except BrokenDevice:  # its capture left the device capturing: its row says so
            record.settle(Verdict(*session.failure[:2]))
            return {**computed(record.columns())}
        pool.run()
    traceback = {TRACEBACK: record.traceback} if record.traceback else {}
    return {**computed(record.columns()), **traceback}


def invalid_row(raw: dict, variant_name: str, message: str) -> Record:
    """The record of a point whose config did not validate: the values as given, status
    ``invalid``."""
    options = {
        k: v
        for k, v in (raw.get("variant") or {}).items()
        if k not in ("_target_", *DECLARATION_KEYS)
    }
    spec = VariantSpec(variant_name, str((raw.get("variant") or {}).get("_target_")), options)
    identity = Identity(
        **{k: raw.get(k) for k in IDENTITY_KEYS if k != "variant"},
        variant=variant_name,
        variant_options=spec.options_str,
        label=spec.label,
        variant_target=spec.target,
    )
    return Record(identity, Environment(**env_columns("cpu"))).settle(Verdict("invalid", message))

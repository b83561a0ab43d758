"""What a failure inside a point means: its status (oom, unsupported, error) and one-line message.

Shared by the point's own stages and by the rounds that time it later, so a failure reads the
same wherever it happens. The texts libraries raise are matched here, in one table each.
"""

from __future__ import annotations

import re
import signal
import sys
import traceback


class Unsupported(Exception):
    """This machine or backend cannot run the point as asked; recorded as ``unsupported``."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, ``kill``, a cluster's time limit) or SIGHUP (the terminal or ssh
    session closed): the sweep stops as on Ctrl-C, keeping what finished, and exits 128 + the
    signal's number (143, 129) instead of 130."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = int(signum)

    @property
    def said(self) -> str:
        """ "terminated (SIGTERM)", "hung up (SIGHUP)": what the console says."""
        hup = self.signum == getattr(signal, "SIGHUP", None)
        return "hung up (SIGHUP)" if hup else "terminated (SIGTERM)"

    @property
    def code(self) -> int:
        return 128 + self.signum


class BusyStop(KeyboardInterrupt):
    """``timing.when_busy=stop``: the rounds found the machine busy (contention spoiled half a
    round's repetitions) and the sweep stops as on Ctrl-C, keeping what finished, exit 3 (not
    comparable: what a busy machine times decides nothing)."""

    code = 3
    said = "stopped: the machine is busy (timing.when_busy=stop)"


def stop_code(exc: KeyboardInterrupt) -> int:
    """The exit code of a stop: 130 for Ctrl-C, 128 + the signal for ``Terminated``, 3 for
    ``BusyStop``."""
    return getattr(exc, "code", None) or 130


def stop_said(exc: KeyboardInterrupt) -> str:
    return getattr(exc, "said", None) or "interrupted"


def stop_within(exc: BaseException | None) -> KeyboardInterrupt | None:
    """The stop (Ctrl-C, SIGTERM, SIGHUP) that ``exc`` is, or that it hides: a library whose
    cleanup fails while a stop unwinds it raises its own error with the stop as its context
    (Hydra's config reader closes in ``finally`` a file it never opened: an UnboundLocalError
    where Ctrl-C came while it composed the next job). None: not a stop."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class BrokenDevice(Exception):
    """A sticky CUDA error ended the rounds: the process's CUDA context is unusable and every
    later call in it would fail. The worker hands back what it has and is replaced."""


# Text in an exception's message -> its status. Matched in order, ignoring case.
STATUS_BY_TEXT = [
    ("out of memory", "oom"),
    ("can't allocate memory", "oom"),
    # cuBLAS / cuDNN could not allocate their handles or workspace: memory, not a bug
    ("CUBLAS_STATUS_ALLOC_FAILED", "oom"),
    ("CUDNN_STATUS_ALLOC_FAILED", "oom"),
    ("ALLOCATION_FAILED", "oom"),  # cuDNN 9: CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED
    # Triton: the kernel's tiles need more shared memory than this GPU has
    ("out of resource: shared memory", "unsupported"),
    # inductor's FlexAttention below head_dim 16 (tl.dot's minimum), wrapped by Dynamo
    ("NYI: embedding dimension of the query, key, and value must be at least 16", "unsupported"),
    # inductor cannot lower FlexAttention inside a compiled module for some input layouts
    # (torch 2.13, CPU: three separate projections under compile=default)
    ("target: flex_attention", "unsupported"),
    ("not implemented for", "unsupported"),
    ("No available kernel", "unsupported"),
    ("No viable backend", "unsupported"),
]

# CUDA errors that leave the process's context unusable (every later call fails the same way).
STICKY_TEXTS = (
    "an illegal memory access was encountered",
    "device-side assert triggered",
    "unspecified launch failure",
    "misaligned address",
    "an illegal instruction was encountered",
    "invalid program counter",
    "uncorrectable ECC error",
    "the launch timed out and was terminated",
)
RESTARTED = "; a sticky CUDA error: the worker was restarted, later points ran in a fresh one"

# Texts too terse to act on, and what they mean.
EXPLAINED = {
    "fail_on_recompile_limit_hit": (
        "Dynamo's recompile limit was reached: torch.compile would have run this point eagerly "
        "(harness/way/compiling.py, RECOMPILE_LIMIT)"
    ),
    "target: flex_attention": (
        "torch.compile (inductor) could not lower FlexAttention in this compiled module: a "
        "limit of the installed torch for this layout of the inputs, not a wrong result"
    ),
}


def traceback_of(exc: BaseException) -> str:
    """``exc``'s traceback as Python prints it, its causes included."""
    return "".join(traceback.format_exception(exc)).rstrip()


# What a call that fails after a passing check most often means.
REWIND_HINT = (
    "a module or its KV cache that keeps what a call leaves behind fails at a later call; "
    "give it a rewind (docs/adding.md, 'The KV cache contract')"
)


class AfterCheck(Exception):
    """``cause``, raised by a call of the module after its check (``where``): the row's error
    names the call and points at the rewind (``REWIND_HINT``); its status is the cause's."""

    def __init__(self, where: str, cause: BaseException):
        super().__init__(f"{where}: {said(cause)}")
        self.where, self.cause = where, cause


def said(exc: BaseException) -> str:
    """``str(exc)``, or what can be said of it where its ``__str__`` raises: an exception class
    of a variant's or a library's with a broken message must cost its row only, never the
    worker."""
    try:
        return str(exc)
    except Exception as e:  # noqa: BLE001 - whatever it raises, the row says so
        return f"<its message could not be read: {type(e).__name__}>"


def after_check(exc: BaseException, where: str) -> str:
    """The error line of ``exc``, raised by a call after the checked one (``where``): with
    ``REWIND_HINT`` when it is an ``error`` (not an oom, say)."""
    if classify(exc) != "error" or is_sticky(said(exc)):
        return one_line(exc)
    return f"{one_line(exc)} (at {where}: {REWIND_HINT})"


def classify(exc: BaseException) -> str:
    if isinstance(exc, AfterCheck):
        return classify(exc.cause)
    msg = said(exc).lower()
    torch = sys.modules.get("torch")  # torch's own errors exist only where torch was imported:
    # the sweep's process classifies its jobs' failures without importing it (2-3 s a sweep)
    if isinstance(exc, MemoryError) or (torch and isinstance(exc, torch.OutOfMemoryError)):
        return "oom"
    for text, status in STATUS_BY_TEXT:
        if text.lower() in msg:
            return status
    if isinstance(exc, (Unsupported, NotImplementedError)):
        return "unsupported"
    return "error"


def is_sticky(text: str) -> bool:
    """The message of a CUDA error after which the process cannot use the GPU."""
    return any(s in text for s in STICKY_TEXTS)


# torch's advice appended to every CUDA error (the same words whatever went wrong): left out of
# the one line, where it hid the cause (a graph_error of 480 characters, 60 of them the error).
CUDA_ADVICE = re.compile(
    r"\s*(Search for `\w+' in \S+ for more information\.|CUDA kernel errors might be "
    r"asynchronously reported at some other API call, so the stacktrace below might be "
    r"incorrect\.|For debugging consider passing CUDA_LAUNCH_BLOCKING=1\.?|Compile with "
    r"`TORCH_USE_CUDA_DSA` to enable device-side assertions\.)"
)


def one_line(exc: BaseException) -> str:
    if isinstance(exc, AfterCheck):
        return after_check(exc.cause, exc.where)
    text = CUDA_ADVICE.sub("", f"{type(exc).__name__}: {said(exc)}").strip()
    for terse, meaning in EXPLAINED.items():
        if terse in text:
            text = f"{meaning} [{text}]"
    return " ".join(text.split())[:500]


def broke_device(record) -> bool:
    """The record's failure (or its profiling pass's) was a sticky CUDA error."""
    profile_error = record.profile.profile_error if record.profile else ""
    return is_sticky(record.outcome.error or "") or is_sticky(profile_error or "")

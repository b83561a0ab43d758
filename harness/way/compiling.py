"""torch.compile as the harness and its kernels use it: one static graph per point, and never a
silent fall-back to eager (docs/architecture.md, "Compiled points"); and what the compiler says it
did (graphs compiled, CUDA graphs skipped).

Why: Dynamo keeps its compiled graphs per *code object*. Every instance of a class shares its
``forward`` (and every module shares ``nn.Module._call_impl``), so within a sweep's worker a
compiled point reused the graphs of the points before it: the second shape turned the graph
dynamic and later points ran that dynamic graph without compiling (compile_s 0.0006 s), and past
``recompile_limit`` (8) Dynamo quietly ran eager. Here each point's graph hangs off a code
object of its own, is compiled with ``dynamic=False`` (what a user compiling for one shape gets),
and a limit that is still reached raises instead of falling back.
"""

from __future__ import annotations

import itertools
import re
import sys

import torch

_ids = itertools.count()

# Generous for frames that points do share (a kernel compiled once per process, code behind a
# graph break): one entry per shape, dtype and mask kind of a sweep.
RECOMPILE_LIMIT = 1024


def loud_limits() -> None:
    """Raise Dynamo's recompile limits for this process and make reaching one an error."""
    dynamo = torch._dynamo.config
    _at_least(dynamo, "recompile_limit", RECOMPILE_LIMIT)
    _at_least(dynamo, "accumulated_recompile_limit", 4 * RECOMPILE_LIMIT)
    if "fail_on_recompile_limit_hit" in getattr(dynamo, "_config", {}) or hasattr(
        dynamo, "fail_on_recompile_limit_hit"
    ):
        dynamo.fail_on_recompile_limit_hit = True  # the point's row says so, it does not run eager


def _at_least(config, name: str, value: int) -> None:
    """``config.name = max(config.name, value)``. A config entry someone deleted (torch's config
    module hides it: "torch._dynamo.config.recompile_limit does not exist", which failed the
    flex tests' points after other tests in the same process, issue 72) is set again: setting
    an entry of torch's config shows it again."""
    try:
        current = getattr(config, name)
    except AttributeError:
        current = None
    if current is None or current < value:
        setattr(config, name, value)


def own_entry(fn):
    """A function calling ``fn`` whose code object is new, so that Dynamo's cache for it starts
    empty and belongs to this caller alone (``torch.compile``'s docs: caches are per code
    object)."""

    def entry(*args, **kwargs):
        return fn(*args, **kwargs)

    entry.__code__ = entry.__code__.replace(co_name=f"mha_bench_compiled_{next(_ids)}")
    return entry


def compile_static(fn, mode: str | None = None):
    """``torch.compile(fn, mode=mode, dynamic=False)`` with a cache of its own."""
    loud_limits()
    entry = own_entry(fn)
    compiled = torch.compile(entry, mode=mode, dynamic=False)
    compiled.mha_bench_entry = entry  # graph_shapes reads its cache
    return compiled


_DYNAMIC_SIZE = re.compile(r"size=\[[^\]]*None")


def maybe_compile(model: torch.nn.Module, mode: str):
    """The callable to check and time: the module itself, or torch.compile over it with a graph
    of the point's own, static, shape (harness/way/compiling.py: compiled points never reuse each
    other's graphs)."""
    if mode == "off":
        return model
    # mode=None is torch.compile's own default; the other names are passed through.
    return compile_static(model, mode=None if mode == "default" else mode)


# compile modes whose timed call replays CUDA graphs on a GPU -> the same mode without them
WITHOUT_GRAPHS = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}


def probe_compile(model: torch.nn.Module, mode: str, device: str):
    """For the probe of a point whose compiled call replays CUDA graphs: the same compile with
    the graphs off. A replay dispatches no op the profiler can name and allocates nothing, so
    the sdpa_kernel, scores_materialized and peak_mem_mb of such rows came out empty; these are
    the same kernels, run one by one. None where the timed call is probed as it is."""
    if mode in WITHOUT_GRAPHS and device.startswith("cuda"):
        return compile_static(model, mode=WITHOUT_GRAPHS[mode])
    return None


def graph_shapes(compiled) -> str:
    """``static`` or ``dynamic``: whether a graph Dynamo compiled for ``compiled`` (from
    ``compile_static``) takes symbolic sizes, read from its guards (a dynamic dimension is
    guarded as ``size=[2, None, 64]``); ``""`` when nothing was compiled or this torch does not
    say."""
    entry = getattr(compiled, "mha_bench_entry", None)
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        guards = [str(e.guard_manager) for e in _debug_get_cache_entry_list(entry.__code__)]
    except Exception:  # a private API: another torch may lack it
        return ""
    if not guards:
        return ""
    return "dynamic" if any(_DYNAMIC_SIZE.search(g) for g in guards) else "static"


# torch.compile modes whose compiled call replays CUDA graphs (on CUDA, when inductor does not
# skip them).
GRAPH_MODES = ("reduce-overhead", "max-autotune")


def cudagraph_skips() -> int:
    """Inductor's count of graphs it compiled without CUDA graphs although the mode asked for
    them (an input mutated in place, such as a KV cache written at decode; a CPU op); it says so
    in a log line only."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def replays_graphs(point, skipped: int) -> bool | None:
    """The row's ``cuda_graphs``: whether the timed call replays CUDA graphs (None: its compile
    mode asks for none)."""
    if point.compile not in GRAPH_MODES:
        return None
    return point.device.startswith("cuda") and skipped == 0


def compiled_graphs() -> int:
    if "torch._dynamo" not in sys.modules:  # importing dynamo costs a second; nothing compiled yet
        return 0
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]

"""The timed call (``timed_call``: shared by the probe, the rounds and the profiling pass), and
timed equals checked: after a point's rounds, one more call on the checked inputs, untimed.

The check (``harness.way.checks``) sees the variant's first call; the rounds time the calls
after it. A module whose output depends on what earlier calls left behind (a KV cache that keeps
what each step appends, as transformers' DynamicCache does; a counter; a buffer filled in place)
passes the check and is then timed computing something else. So the harness counts the calls
made after the check (``Counted``) and, once the rounds are over, makes one more (after the
point's ``before``: its rewind, and clearing gradients) and compares its output with the checked
one, within the tolerance the check used for the output (``Recheck``). With check_only, where no
call is timed, the check itself repeats its first call once, after the rewind
(harness/way/calls.py, ``repeated``), and compares the same way (``Recheck.repeated``). A
difference is a ``mismatch`` (its timing stays in the row, out of every ranking, effect and
figure). Where two calls from the same random state agree and one from another state does not,
the module is random from call to call (dropout in train mode), and the error says that instead.
docs/methodology.md, "What was timed is what was checked".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from harness.way.calls import Inputs
from harness.way.calls import for_module, rewinder
from harness.way.checks import max_error


class Counted:
    """``call`` that counts its calls: the timed calls between the check and the re-check."""

    def __init__(self, call: Callable[[], object]):
        self.call, self.n = call, 0

    def __call__(self):
        self.n += 1
        return self.call()


def output_of(result) -> torch.Tensor:
    """The output tensor of a timed call's result: (out, weights), or out."""
    out = result[0] if isinstance(result, (tuple, list)) else result
    return out.detach()


def changed(when: str, said: str) -> str:
    """The error of an output that changed from one call to a later one (``when``)."""
    return (
        f"the output changed {when} ({said}): the module or its KV cache keeps what a call "
        "leaves behind; give it a rewind (docs/adding.md, 'The KV cache contract')"
    )


@dataclass
class Recheck:
    expected: torch.Tensor  # (B, L, E): the checked call's output, on the point's device
    tolerance: float  # the check's tolerance for the output
    device: str

    def __call__(self, call: Counted, before: Callable[[], object] | None) -> str | None:
        """None when one more call gives the checked output; else the row's error."""
        after = call.n
        diff, _, problem = max_error(self._once(call, before), self.expected)
        if diff <= self.tolerance:
            return None
        said = problem or f"max difference {diff:.3g} > tolerance {self.tolerance:.3g}"
        # Random: two calls from one random state agree, two from different states do not. (A
        # cache that keeps growing changes little from one call to the next: not random.)
        a, b = (self._once(call, before, seeded=True) for _ in range(2))
        c = self._once(call, before)
        if max_error(b, a)[0] <= self.tolerance < max_error(c, b)[0]:
            return (
                f"the output differs from one call to the next ({said} after {after} timed "
                "calls, while two calls from the same random state agree): a random module "
                "(dropout in train mode?) is not the one that was checked; put it in eval mode"
            )
        return changed(f"after {after} timed calls", said)

    def replayed(
        self, replay: Callable[[], object], before: Callable[[], object] | None, after: int
    ) -> str | None:
        """The replay of the CUDA graph the rounds timed as device time (harness/measure/
        session.py), once more after the rewind: None when it gives the checked output. A graph
        replays only the GPU work it captured, at the addresses and positions of the capture:
        work on the host, or a state a call reads from Python, is not in it."""
        if before:
            before()
        diff, _, problem = max_error(output_of(replay()).clone(), self.expected)
        if diff <= self.tolerance:
            return None
        said = problem or f"max difference {diff:.3g} > tolerance {self.tolerance:.3g}"
        return (
            f"the CUDA graph replay timed as device time gives another output than the checked "
            f"call ({said} after {after} replays): part of the call is not in the graph (work on "
            "the host, a state read from Python); timing.cuda_graph=false times it eagerly only"
        )

    def repeated(self, again: torch.Tensor) -> str | None:
        """The gate's (check_only) comparison: None when the checked call, repeated once after
        the rewind, gave the checked output (``again``), or when the output holds no values to
        compare (the meta device: the check said so); else the row's error."""
        if self.expected.is_meta:
            return None
        diff, _, problem = max_error(again, self.expected)
        if diff <= self.tolerance:
            return None
        said = problem or f"max difference {diff:.3g} > tolerance {self.tolerance:.3g}"
        return changed("when the checked call was repeated", said)

    def _once(self, call, before, seeded: bool = False) -> torch.Tensor:
        devices = [torch.cuda.current_device()] if self.device.startswith("cuda") else []
        with torch.random.fork_rng(devices=devices, enabled=seeded):
            if seeded:
                torch.manual_seed(0)
            if before:
                before()
            return output_of(call())


def timed_call(model, fn, inputs: Inputs, mode: str):
    """The zero-argument callable to time and what to run before each call, untimed: the rewind
    of a module or KV cache that commits what a call appends (``collect.rewinder``), and in
    fwd_bwd clearing the gradients. The call returns the forward's (out, weights): the re-check
    after the rounds compares it with the checked output (harness/way/recheck.py)."""
    inputs = for_module(inputs, model)  # decode: its cache (filled here, untimed), or the sequence
    q, k, v, kwargs, grad_out = (
        inputs.query,
        inputs.key,
        inputs.value,
        inputs.kwargs,
        inputs.grad_out,
    )
    rewind = rewinder(model, kwargs)
    if mode == "fwd":

        def call():
            with torch.no_grad():
                return fn(q, k, v, **kwargs)

        return call, rewind

    leaves = list(inputs.named().values())

    def clear_grads():
        if rewind is not None:
            rewind()
        model.zero_grad(set_to_none=True)
        for t in leaves:
            t.grad = None

    def call():
        result = fn(q, k, v, **kwargs)
        result[0].backward(grad_out)
        return result

    return call, clear_grads

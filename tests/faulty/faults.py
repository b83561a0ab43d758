"""Variants that break the drop-in contract or the process, each in one way (the faulty gallery).

Every one is the project's fused variant with one thing wrong in its forward, so the harness
must tell it apart from a correct module by what it does, not by what it computes.
"""

import os
import signal
import sys
import time

from harness.measure.phase import current
from variants.fused import FusedQKVMHA


class ExitsInForward(FusedQKVMHA):
    def forward(self, *args, **kwargs):
        sys.exit(3)  # a SystemExit: an exception like any other, an `error` row


class OsExitInForward(FusedQKVMHA):
    def forward(self, *args, **kwargs):
        os._exit(3)  # no exception, no cleanup: the process is gone


class AbortsInForward(FusedQKVMHA):
    def forward(self, *args, **kwargs):
        os.abort()  # what a native crash looks like: SIGABRT


class KilledInForward(FusedQKVMHA):
    def forward(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does


class HangsInForward(FusedQKVMHA):
    def forward(self, *args, **kwargs):
        while True:
            time.sleep(1)


class CrashesInRounds(FusedQKVMHA):
    """Correct for its first calls (check, warm-up, probe), then dies at its first call in a
    timing round (harness.measure.phase), however fast the machine is."""

    def forward(self, *args, **kwargs):
        if current() == "rounds":
            os._exit(7)
        return super().forward(*args, **kwargs)


class Float64Out(FusedQKVMHA):
    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out.double(), weights  # the right numbers in the wrong dtype


class MutatesQuery(FusedQKVMHA):
    def forward(self, query, key, value, **kwargs):
        result = super().forward(query, key, value, **kwargs)
        query.data.mul_(0.5)  # the right output, but the caller's tensor is changed
        return result


class MutatesMask(FusedQKVMHA):
    def forward(self, query, key, value, key_padding_mask=None, attn_mask=None, **kwargs):
        result = super().forward(
            query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask, **kwargs
        )
        if key_padding_mask is not None:
            key_padding_mask.data.fill_(False)
        return result


class LeaksOutputs(FusedQKVMHA):
    """Correct, but keeps every output it ever returned, 2048 copies each (1 MiB at the tests'
    tiny shape): memory grows with every call by more than the leak flag's 1 MiB over a point's
    rounds however few calls a loaded machine makes in them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept = []

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        self.kept.append(out.detach().clone().repeat(2048, 1, 1))
        return out, weights


class BreaksTheDevice(FusedQKVMHA):
    """What a sticky CUDA error does (an illegal address, a device-side assert): its call fails,
    and so does every later call in the process, whoever makes it. Simulated on any device: from
    its first call in phase ``break_in`` on (harness.measure.phase), F.linear (every variant's
    and nn.MHA's projections) raises the message CUDA gives."""

    def __init__(self, *args, break_in: str = "setup", **kwargs):
        super().__init__(*args, **kwargs)
        self.break_in = break_in  # setup: at its first call (the check); rounds: in its rounds

    def forward(self, *args, **kwargs):
        if self.break_in == "setup" or current() == self.break_in:
            import torch.nn.functional as F

            def broken(*a, **k):
                raise RuntimeError(
                    "CUDA error: an illegal memory access was encountered\n"
                    "CUDA kernel errors might be asynchronously reported at some other API call"
                )

            F.linear = broken
        return super().forward(*args, **kwargs)


class InterruptsInForward(FusedQKVMHA):
    def forward(self, *args, **kwargs):
        raise KeyboardInterrupt  # its own, not a Ctrl-C: the worker running it ignores those


class MetaOut(FusedQKVMHA):
    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out.to("meta"), weights  # the right shape on a device that holds no numbers

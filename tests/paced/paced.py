"""Two correct modules whose times differ by a known factor: each sleeps a fixed time per call
(sleep needs no CPU, so a busy machine keeps the ratio), then computes nn.MHA's output with the
fused structure. 6 ms against 5 ms: 1.2x, whatever else runs (tests/test_paired_ways.py)."""

import time

from variants.fused import FusedQKVMHA


class Paced(FusedQKVMHA):
    seconds = 0.0

    def forward(self, *args, **kwargs):
        time.sleep(self.seconds)
        return super().forward(*args, **kwargs)


class SixMs(Paced):
    seconds = 0.006


class FiveMs(Paced):
    seconds = 0.005

"""Two correct modules whose times differ by a known factor: each computes nn.MHA's output with
the fused structure, 6 times and 5 times per call (the last result returned). CPU work, not
sleep: on a loaded machine a sleep's wake-up adds the same milliseconds to both and shrinks the
ratio, while the same work slows down alike in both and the rounds pair it out
(tests/test_paired_ways.py): 1.2x, less the harness's own few microseconds per call."""

from variants.fused import FusedQKVMHA


class Paced(FusedQKVMHA):
    times = 1

    def forward(self, *args, **kwargs):
        for _ in range(self.times - 1):
            super().forward(*args, **kwargs)
        return super().forward(*args, **kwargs)


class SixMs(Paced):  # the names of the yaml files: six and five
    times = 6


class FiveMs(Paced):
    times = 5

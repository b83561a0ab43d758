"""Stage 3, measuring: the timer (``timing``), interleaved rounds paired with nn.MHA
(``rounds``), intervals (``stats``), FLOPs and peaks (``flops``, ``roofline``), memory
(``footprint``, ``probe``) and the profiler pass (``profiling``)."""

"""The measure stage: the timer (``timing``), interleaved rounds paired with nn.MHA
(``rounds``), intervals (``stats``), FLOPs and peaks (``flops``, ``roofline``), memory
(``footprint``, ``probe``, ``memory``), the timed call (``calls``), the journal of
repetitions (``journal``) and the profiler pass (``profiling``)."""

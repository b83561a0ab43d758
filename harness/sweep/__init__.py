"""The sweep stage: the Hydra entry point (``run``), the worker process every point runs in
(``worker``), and the end of a run or sweep (``callbacks``: results.csv, ranking, report).
The sweeper itself is in hydra_plugins/mha_bench/sweeper.py (Hydra loads sweepers only there)."""

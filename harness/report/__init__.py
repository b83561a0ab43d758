"""The report stage: the HTML report (``render`` with ``figures`` and ``templates/``), winners
or ties per shape (``ranking``), A/B comparison (``compare``) and TensorBoard (``tensorboard``).
Reads CSVs only; nothing here runs a point."""

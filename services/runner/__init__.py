"""`python -m services.runner MODEL`: test one model, print a JSON report.

Four rooms, as in optimum-benchmark: ``backends`` (where it runs), ``launch`` (child processes, timeout,
traceback capture), ``tasks`` (what is run), ``measure`` and ``verdict`` (timings, memory, the rule).
This package runs only in runner processes: the worker starts it as a child and never imports it.
"""

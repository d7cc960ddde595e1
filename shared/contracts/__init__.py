"""The ground floor: typed records that cross a process boundary, and nothing else.

- ``run``: what a runner is asked (``RunRequest``) and what runs it (``RuntimeInfo``);
- ``report``: a finished test (``RunReport``), composed of parts, each field declared once;
- ``handoffs``: what a job's stages hand each other through its artifact directory;
- ``evidence``: what the verdict rule rules on;
- ``enums``: the codes used everywhere (SQL, API, Parquet, metrics); ``fields``: the widths fields declare.

Nothing here imports the rest of the project (``tests/test_boundaries.py``): the SQL schema, the Parquet
schema and the runner all build on these records, never the other way round.
"""

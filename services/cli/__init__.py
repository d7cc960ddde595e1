"""`supportmatrix`: the command line of the service (`app.py`).

Most commands talk to the service over its HTTP API, through the one client in `client.py`, and validate what
they send and read with the API's own request and response models (`services/api/schemas.py`). Two do not,
because the API has no route for them, and they say so in their help: `tokens` and `export` open the database
(SUPPORTMATRIX_DATABASE_URL) on this machine — run them where the service's settings are. `run` starts the
runner here, as a child process. Nothing here imports torch or the runner.
"""

"""`supportmatrix`: the command line over the HTTP API (`app.py`, through the one client in `client.py`).

Two commands do not go through the API, because it has no route for them: `tokens` and `export` open the
database (SUPPORTMATRIX_DATABASE_URL), as `python -m services.api.tokens` and the collector do. `run` starts
the runner here, as a child process. Nothing here imports torch or the runner.
"""

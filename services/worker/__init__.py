"""The Celery worker: claims jobs, runs each in an isolated runner process, writes the result."""

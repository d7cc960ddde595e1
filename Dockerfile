# The cpu image: the API, the host launcher with its workers (backend cpu), the control worker and beat.
#   docker build -t supportmatrix:cpu .
# Pins: the base image by tag and digest; torch from constraints/cpu.txt (its CPU wheel); the project's other
# dependencies as pyproject.toml states them, then the project itself without re-resolving anything.
#
# The digest is the python:3.11-slim index digest found in public Dockerfiles that build on it; it could not
# be checked against Docker Hub from where this file was written (no registry access there).
FROM python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# torch first, from its CPU index: an unpinned torch from PyPI is a multi-GB CUDA build.
COPY constraints/ constraints/
RUN pip install --index-url https://download.pytorch.org/whl/cpu -c constraints/cpu.txt torch

# The other dependencies, read from pyproject.toml, in a layer of their own (source edits do not rebuild it).
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
 && pip install -c constraints/cpu.txt -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# The project, editable: shared.db.migrate finds alembic.ini and migrations/ beside the source tree.
COPY README.md alembic.ini ./
COPY migrations/ migrations/
COPY shared/ shared/
COPY services/ services/
COPY tasks/ tasks/
COPY deploy/healthcheck.py deploy/healthcheck.py
COPY scripts/trn2_check.py scripts/trn2_check.py
RUN pip install --no-deps -e .

# Everything the services write lives under these mount points (named volumes in docker-compose.yml).
# The user `app`, by number (as the runtime resolves it without the image's /etc/passwd).
# The runners' user (shared/isolation.py): a worker running as root runs transformers' code as it, and a repo's own
# code as a uid of its job's own (SUPPORTMATRIX_SANDBOX_UIDS, no account's: none is made here); neither can read the
# services' environments or the database file.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin app \
 && useradd --system --uid 10002 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin supportmatrix-runner \
 && mkdir -p /data /export /cache /hf \
 && chown app:app /data /export /cache /hf
ENV SUPPORTMATRIX_DATA_DIR=/data \
    SUPPORTMATRIX_EXPORT_DIR=/export \
    SUPPORTMATRIX_CACHE_DIR=/cache \
    HF_HOME=/hf
USER 10001:10001

EXPOSE 8000
CMD ["uvicorn", "services.api.main:app", "--host", "0.0.0.0", "--port", "8000"]

"""the whole software stack is a job's identity: torch joins it, job queues are named by the stack, and a queue
seen live keeps the runtime its workers serve

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-02 18:00:00
"""

import hashlib
import re
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACTIVE = ("queued", "running", "judging")
WHERE_ACTIVE = "state IN ('queued', 'running', 'judging')"
# The stack in its field order (shared.contracts.run.Stack), and the identity's columns before and after.
STACK = ("compiler_version", "torch_version", "torch_neuronx_version", "neuron_runtime_version", "library_version")
OLD_IDENTITY = ["model_id", "sha", "compiler_version", "library_version", "torch_neuronx_version",
                "neuron_runtime_version", "task", "config_hash", "cores"]  # fmt: skip
NEW_IDENTITY = ["model_id", "sha", *STACK, "task", "config_hash", "cores"]


# Queue names as this revision writes them, kept here rather than imported: a migration must do tomorrow what it
# does today (tests/test_schema.py checks that they equal shared.jobs.queues.job_queue's).
def _safe(version: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+_-]", "_", version)


def stack_queue(backend: str, versions: Sequence[str], cores: int) -> str:
    return f"supportmatrix.jobs.{backend}.{_safe(versions[0])}.stack-{_stack_digest(versions)}.c{cores}"


def compiler_queue(backend: str, versions: Sequence[str], cores: int) -> str:
    return f"supportmatrix.jobs.{backend}.{_safe(versions[0])}.c{cores}"


def _rename_active_queues(name: str) -> None:
    """Give every job still to run the queue its stack is served on now, so that the reconciler re-sends it there;
    and mark each new queue live as its old one was, so that no job ends ERROR(no_worker) before the workers that
    serve its stack have started."""
    queue_of = stack_queue if name == "stack" else compiler_queue
    bind = op.get_bind()
    jobs = sa.table("jobs", *(sa.column(c) for c in ("id", "backend", "cores", "queue", "state", *STACK)))
    seen = sa.table("queues_seen", sa.column("queue"), sa.column("last_live_at"))
    columns = [jobs.c.id, jobs.c.backend, jobs.c.cores, jobs.c.queue, *(jobs.c[c] for c in STACK)]
    rows = bind.execute(sa.select(*columns).where(jobs.c.state.in_(ACTIVE))).all()
    last_live = dict(bind.execute(sa.select(seen.c.queue, seen.c.last_live_at)).tuples().all())
    marked: set[str] = set(last_live)
    for job_id, backend, cores, old, *versions in rows:
        new = queue_of(backend, [v or "" for v in versions], cores)
        bind.execute(sa.update(jobs).where(jobs.c.id == job_id).values(queue=new))
        if new not in marked and old in last_live:
            bind.execute(sa.insert(seen).values(queue=new, last_live_at=last_live[old]))
            marked.add(new)


# A RuntimeInfo's fields as this revision writes one into queues_seen.runtime (shared.contracts.run.RuntimeInfo).
RUNTIME = ("compiler_version", "library_version", "torch_version", "torch_neuronx_version", "neuron_runtime_version",
           "compiler_build", "backend", "compiler_name", "library")  # fmt: skip
# The versions a worker read at run time and reported in the result, where a job before this revision kept what it
# was planned for (a worker then ran any job of its compiler): a row states what ran.
REPORTED = ("torch_version", "torch_neuronx_version", "neuron_runtime_version")


def _seen_with_runtimes() -> None:
    """Say, of each stack's new queue, the runtime its workers served (from the newest row of the workers that
    served it), so that a fleet scaled to zero as this revision runs is planned for the stacks it served last rather
    than for a stack read from the API's own packages (for a neuron fleet, one no worker serves). A new queue not
    marked live already (by its active jobs) was last live at its newest worker's last heartbeat."""
    bind = op.get_bind()
    workers = sa.table("workers", *(sa.column(c) for c in ("queue", "core_count", "heartbeat_at", *RUNTIME)))
    seen = sa.table("queues_seen", sa.column("queue"), sa.column("last_live_at"), sa.column("runtime", sa.JSON()))
    marked = set(bind.execute(sa.select(seen.c.queue)).scalars())
    newest_first = sa.select(workers).order_by(workers.c.heartbeat_at.desc())
    said: set[str] = set()
    for worker in bind.execute(newest_first).mappings():
        runtime = {name: worker[name] for name in RUNTIME}
        queue = stack_queue(worker["backend"], [worker[v] or "" for v in STACK], worker["core_count"])
        if queue in said:
            continue
        said.add(queue)
        if queue in marked:
            bind.execute(sa.update(seen).where(seen.c.queue == queue).values(runtime=runtime))
        else:
            bind.execute(sa.insert(seen).values(queue=queue, last_live_at=worker["heartbeat_at"], runtime=runtime))


def _finished_jobs_state_what_ran() -> None:
    """A finished job keeps the torch, TorchNeuron and runtime versions its result reported where they differ (and
    the result said one): before this revision a job kept what it was planned for while any build of its compiler
    could run it, and rows now state the job's columns. No active-identity index covers finished jobs."""
    jobs = sa.table("jobs", sa.column("id"), sa.column("state"), *(sa.column(c) for c in REPORTED))
    results = sa.table("results", sa.column("job_id"), *(sa.column(c) for c in REPORTED))
    for name in REPORTED:
        reported = sa.select(results.c[name]).where(results.c.job_id == jobs.c.id).scalar_subquery()
        differs = sa.exists().where(
            results.c.job_id == jobs.c.id,
            results.c[name].is_not(None),
            results.c[name] != "",
            results.c[name] != sa.func.coalesce(jobs.c[name], ""),
        )
        op.get_bind().execute(
            sa.update(jobs).where(jobs.c.state.in_(("done", "failed")), differs).values({name: reported})
        )


def _stack_digest(versions: Sequence[str]) -> str:
    """shared.contracts.run.Stack.digest as this revision computes it (``stack_queue`` names queues by the same)."""
    return hashlib.sha256("".join(f"{v}\n" for v in versions).encode()).hexdigest()[:12]


def _store_stack_digests() -> None:
    """Every job's stack digest, written once per stack: what the stack axis of a diff reads through its index. After
    ``_finished_jobs_state_what_ran``, which changes finished jobs' versions."""
    bind = op.get_bind()
    jobs = sa.table("jobs", sa.column("stack_digest"), *(sa.column(c) for c in STACK))
    for versions in bind.execute(sa.select(*(jobs.c[c] for c in STACK)).distinct()).all():
        of_stack = [jobs.c[c] == v if v is not None else jobs.c[c].is_(None) for c, v in zip(STACK, versions)]
        digest = _stack_digest([v or "" for v in versions])
        bind.execute(sa.update(jobs).where(*of_stack).values(stack_digest=digest))


def upgrade() -> None:
    with op.batch_alter_table("queues_seen", schema=None) as batch_op:
        batch_op.add_column(sa.Column("runtime", sa.JSON(), nullable=True))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("uq_jobs_active_identity")
        batch_op.create_index(
            "uq_jobs_active_identity", NEW_IDENTITY, unique=True,
            sqlite_where=sa.text(WHERE_ACTIVE), postgresql_where=sa.text(WHERE_ACTIVE),
        )  # fmt: skip
    _rename_active_queues("stack")
    _seen_with_runtimes()
    _finished_jobs_state_what_ran()
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("stack_digest", sa.String(12), server_default="", nullable=False))
    _store_stack_digests()
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index("ix_jobs_diff_stack", ["stack_digest", "model_id", "task"])


def downgrade() -> None:
    # Finished jobs keep the versions their results reported (what ran): true under either revision.
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_diff_stack")
        batch_op.drop_column("stack_digest")
    # Two active jobs that differ only in torch's version are one test again: the index refuses them (finish or
    # cancel one first).
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("uq_jobs_active_identity")
        batch_op.create_index(
            "uq_jobs_active_identity", OLD_IDENTITY, unique=True,
            sqlite_where=sa.text(WHERE_ACTIVE), postgresql_where=sa.text(WHERE_ACTIVE),
        )  # fmt: skip
    _rename_active_queues("compiler")
    with op.batch_alter_table("queues_seen", schema=None) as batch_op:
        batch_op.drop_column("runtime")

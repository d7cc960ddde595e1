"""the results' version: one number every transaction that writes results raises as it commits

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02 05:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The number is raised to at least the time of the raise in microseconds (since 1970), not only by one: a database
# restored from a backup, or this migration undone and done again, goes on above every number it held before, so
# that an API process that kept answers across it never meets an old number over other rows.
NOW_US = {
    "postgresql": "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
    "sqlite": "CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER)",
}
# PostgreSQL: a deferred constraint trigger raises the number as the writer commits, after every other statement of
# its transaction. The row's lock is then the last one a writer takes, so that writers wait for each other only to
# commit, and never deadlock over it (an immediate trigger would hold it while its transaction went on to take
# others). Once per transaction: a bulk insert queues one call per row. The table is named in the schema of the
# results written, whatever the writer's search_path.
POSTGRESQL_UP = [
    f"""
    CREATE FUNCTION results_version_raise() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF current_setting('supportmatrix.results_version_raised', true) IS DISTINCT FROM 'yes' THEN
            EXECUTE format('UPDATE %I.results_version SET version = greatest(version + 1, $1) WHERE id = 1',
                           TG_TABLE_SCHEMA)
            USING {NOW_US["postgresql"]};
            PERFORM set_config('supportmatrix.results_version_raised', 'yes', true);
        END IF;
        RETURN NULL;
    END $$
    """,
    """
    CREATE CONSTRAINT TRIGGER results_version_raise AFTER INSERT OR UPDATE OR DELETE ON results
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION results_version_raise()
    """,
    """
    CREATE TRIGGER results_version_raise_on_truncate AFTER TRUNCATE ON results
    FOR EACH STATEMENT EXECUTE FUNCTION results_version_raise()
    """,
]
POSTGRESQL_DOWN = [
    "DROP TRIGGER results_version_raise_on_truncate ON results",
    "DROP TRIGGER results_version_raise ON results",
    "DROP FUNCTION results_version_raise()",
]
# SQLite: one writer at a time, so an ordinary trigger per row is enough.
SQLITE_EVENTS = ("insert", "update", "delete")


def upgrade() -> None:
    op.create_table(
        "results_version",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    dialect = op.get_bind().dialect.name
    op.execute(f"INSERT INTO results_version (id, version) VALUES (1, {NOW_US[dialect]})")
    if dialect == "postgresql":
        for statement in POSTGRESQL_UP:
            op.execute(statement)
    else:
        for event in SQLITE_EVENTS:
            op.execute(
                f"CREATE TRIGGER results_version_on_{event} AFTER {event.upper()} ON results "
                f"BEGIN UPDATE results_version SET version = max(version + 1, {NOW_US['sqlite']}) WHERE id = 1; END"
            )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for statement in POSTGRESQL_DOWN:
            op.execute(statement)
    else:
        for event in SQLITE_EVENTS:
            op.execute(f"DROP TRIGGER results_version_on_{event}")
    op.drop_table("results_version")

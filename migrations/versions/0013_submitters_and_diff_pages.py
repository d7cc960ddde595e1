"""who submitted a job or a sweep; indexes for a diff's pages

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01 12:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for table in ("jobs", "sweeps"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("submitted_by", sa.String(length=64), nullable=True))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index("ix_jobs_diff_compiler", ["compiler_version", "model_id", "task", "library_version"])
        batch_op.create_index("ix_jobs_diff_library", ["library_version", "model_id", "task", "compiler_version"])


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_diff_library")
        batch_op.drop_index("ix_jobs_diff_compiler")
    for table in ("jobs", "sweeps"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("submitted_by")

"""what ran a task and what it produced: embeddings' shape, the image's agreement and its steps

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01 17:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = [
    sa.Column("denoise_step_s", sa.Double(), nullable=True),
    sa.Column("image_psnr", sa.Double(), nullable=True),
    sa.Column("image_ssim", sa.Double(), nullable=True),
    sa.Column("pipeline_library", sa.String(length=32), nullable=True),
    sa.Column("pipeline_library_version", sa.String(length=64), nullable=True),
    sa.Column("embedding_dim", sa.Integer(), nullable=True),
    sa.Column("embedding_pooling", sa.String(length=64), nullable=True),
    sa.Column("embedding_normalized", sa.Boolean(), nullable=True),
    sa.Column("denoiser", sa.String(length=64), nullable=True),
    sa.Column("image_size", sa.Integer(), nullable=True),
    sa.Column("denoising_steps", sa.Integer(), nullable=True),
]


def upgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        for column in COLUMNS:
            batch_op.add_column(column)


def downgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        for column in reversed(COLUMNS):
            batch_op.drop_column(column.name)

"""What a token may do. Kept apart from the token rules so that the table can name it without a cycle."""

from __future__ import annotations

from enum import StrEnum


class Scope(StrEnum):
    submit = "submit"  # submit models, cancel jobs
    admin = "admin"  # also: rerun finished jobs (force) and start sweeps

    def covers(self, needed: Scope) -> bool:
        return self is Scope.admin or needed is self

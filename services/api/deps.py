"""Dependencies as Annotated aliases, so route signatures stay short."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from celery import Celery
from fastapi import Depends
from sqlalchemy.orm import Session

from shared.db.engine import new_session
from shared.jobs.broker import get_producer
from shared.settings import Settings, get_settings


def get_session() -> Iterator[Session]:
    with new_session() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
ProducerDep = Annotated[Celery, Depends(get_producer)]

"""The one place configuration is read from: the environment, prefix ``SUPPORTMATRIX_``."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

BackendName = Literal["cpu", "cuda", "neuron"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SUPPORTMATRIX_", extra="ignore")

    data_dir: Path = Field(Path(".data"), description="Root of everything the service writes locally.")
    database_url: str = Field("", description="SQLAlchemy URL; default: a SQLite file in data_dir.")
    redis_url: str = "redis://127.0.0.1:6379/0"
    backend: BackendName = "cpu"
    export_dir: Path | None = Field(None, description="Parquet export root; default data_dir/export.")
    cache_dir: Path | None = Field(None, description="Compile caches (inductor, NEFF); default data_dir/cache.")

    # What the cpu backend hands to torch.compile; tests may pick the cheaper "aot_eager".
    cpu_compile_backend: str = "inductor"
    # Compiler version a job gets when no live worker says what it serves (e.g. "inductor-2.13.0+cpu").
    default_compiler: str | None = None

    job_timeout_s: float = Field(3600.0, gt=0, description="Hard limit on one runner process.")
    heartbeat_interval_s: float = Field(5.0, gt=0)
    lease_timeout_s: float = Field(120.0, gt=0, description="A running job whose heartbeat is older is stale.")
    max_attempts: int = Field(3, ge=1, description="Deliveries of one job before it ends ERROR(worker_lost).")
    worker_stale_s: float = Field(60.0, gt=0, description="A worker whose heartbeat is older is not live.")

    api_max_body_bytes: int = Field(65536, gt=0)
    page_limit_max: int = Field(1000, gt=0)

    @model_validator(mode="after")
    def _fill_derived_paths(self) -> Settings:
        self.data_dir = self.data_dir.expanduser().resolve()
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'supportmatrix.db'}"
        self.export_dir = (self.export_dir or self.data_dir / "export").expanduser().resolve()
        self.cache_dir = (self.cache_dir or self.data_dir / "cache").expanduser().resolve()
        return self

    @property
    def export_path(self) -> Path:
        assert self.export_dir is not None
        return self.export_dir

    @property
    def cache_path(self) -> Path:
        assert self.cache_dir is not None
        return self.cache_dir


@lru_cache
def get_settings() -> Settings:
    return Settings()


def child_environment(overrides: dict[str, str]) -> dict[str, str]:
    """The environment for a child process: ours, with ``overrides`` applied.

    Children (runner, ranks) inherit HF_* and SUPPORTMATRIX_* as they are, so they read the same settings.
    """
    return {**os.environ, **overrides}

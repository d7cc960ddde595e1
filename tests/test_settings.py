"""Settings split by the process that reads them: each setting declared once, in one process's class, with
``Settings`` their union; a runner child given the runner's settings, derived from its class, but no secret; and the
runner reading no setting but its own."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from pydantic import ValidationError
from pydantic_settings import BaseSettings

import shared.settings
from shared.settings import (
    RUNNER_SETTINGS,
    VERDICT_SETTINGS,
    RunnerSettings,
    Settings,
    Withheld,
    child_environment,
    withheld,
)
from shared.zygote_client import PER_CHILD_NAMES, SECRET_NAMES
from tests.conftest import ROOT, runner_paths

# Every class a setting may be declared in: the processes' classes, of which Settings is the union.
HOMES = [c for c in vars(shared.settings).values() if isinstance(c, type) and issubclass(c, RunnerSettings)]


def members(cls: type[BaseSettings]) -> set[str]:
    """What a process reading ``cls`` can read of it: its settings, and its classes' properties and methods."""
    return set(cls.model_fields) | ({name for name in dir(cls) if not name.startswith("_")} - set(dir(BaseSettings)))


def runner_modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), filename=str(path))) for path in runner_paths()]


def test_every_setting_is_declared_once_in_the_class_of_the_process_that_reads_it() -> None:
    homes = {
        name: [home.__name__ for home in HOMES if name in inspect.get_annotations(home)]
        for name in Settings.model_fields
    }
    assert {name: where for name, where in homes.items() if len(where) != 1} == {}, "declare each setting once"
    assert inspect.get_annotations(Settings) == {}, "Settings is the union of the processes' classes"
    assert [home.__name__ for home in HOMES if home not in Settings.__mro__] == []
    assert set(VERDICT_SETTINGS) <= set(RunnerSettings.model_fields), "a setting that decides a verdict is run by it"


def test_a_runner_child_is_given_the_runners_settings_but_no_secret() -> None:
    secrets = {name for name in Settings.model_fields if withheld(name) == Withheld.secret}
    assert {name for name in Settings.model_fields if name.endswith("_token")} <= secrets, "mark a token Secret"
    assert {"database_url", "redis_url"} <= secrets  # they hold the stores' passwords
    assert set(RUNNER_SETTINGS) == {name for name in RunnerSettings.model_fields if withheld(name) is None}
    assert RUNNER_SETTINGS.isdisjoint(secrets)
    # The runner's secrets and per-child settings are what its zygote keeps out of its memory and of its checks.
    runners = {f"SUPPORTMATRIX_{name.upper()}": withheld(name) for name in RunnerSettings.model_fields}
    assert {env for env, why in runners.items() if why == Withheld.secret} <= SECRET_NAMES
    assert {env for env, why in runners.items() if why is not None} <= PER_CHILD_NAMES

    # Every secret set: none in a child's environment, and no setting there but the runner's.
    env = child_environment(Settings(**{name: f"secret-{name}" for name in secrets}), {})
    assert [name for name, value in env.items() if value.startswith("secret-")] == []
    passed = {name for name in env if name.startswith("SUPPORTMATRIX_")}
    assert passed and passed <= {f"SUPPORTMATRIX_{name.upper()}" for name in RUNNER_SETTINGS}


def test_the_runner_reads_only_its_own_settings() -> None:
    """services/runner reads a RunnerSettings (``get_runner_settings``), so mypy flags a read of another process's
    setting; this names each such read, and each settings class the runner imports instead."""
    others = {cls.__name__ for cls in HOMES if cls is not RunnerSettings} | {"get_settings"}
    foreign = members(Settings) - members(RunnerSettings)
    imports, reads, read = [], [], set()
    for path, tree in runner_modules():
        where = path.relative_to(ROOT).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "shared.settings":
                imports += [f"{where}:{node.lineno}: {a.name}" for a in node.names if a.name in others]
            if isinstance(node, ast.Attribute):
                read.add(node.attr)
                if node.attr in foreign:
                    reads.append(f"{where}:{node.lineno}: .{node.attr}")
    assert imports == [], "the runner reads RunnerSettings (get_runner_settings) only"
    assert reads == [], "a runner child is given only RunnerSettings: move the setting there, or read another"
    # And RunnerSettings holds only what the runner reads: each of its settings read by the runner, or by a property
    # of RunnerSettings that the runner reads (cache_path reads cache_dir).
    body = ast.parse(inspect.getsource(RunnerSettings)).body[0]
    assert isinstance(body, ast.ClassDef)
    for method in [node for node in body.body if isinstance(node, ast.FunctionDef) and node.name in read]:
        read |= {node.attr for node in ast.walk(method) if isinstance(node, ast.Attribute)}
    unread = sorted(set(RunnerSettings.model_fields) - read)
    assert unread == [], "the runner reads none of these: move them to the class of the process that does"


def test_a_sandbox_uid_range_that_is_empty_or_reaches_root_or_past_65535_is_refused_with_its_reason() -> None:
    """A reversed range would leave a job no uid (a division by zero when it runs); one from 0 would run a repo's code
    as root; one past 65535 is not mapped in a user-namespaced container. Each is refused when the settings are read,
    saying which bounds hold."""
    for wrong in ("60899-60100", "0-10", "999-1000", "60100-65536"):
        with pytest.raises(ValidationError, match="1000 <= FIRST <= LAST < 65536"):
            Settings(sandbox_uids=wrong)
    with pytest.raises(ValidationError, match="pattern"):
        Settings(sandbox_uids="60100")
    assert Settings(sandbox_uids="60100-60100").sandbox_uid_range == range(60100, 60101)

"""Publishing the export to a Hub dataset repo, through huggingface_hub, against the stand-in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import sqlalchemy as sa
import yaml
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import HfHubHTTPError
from sqlalchemy.orm import Session

from shared.contracts.enums import Verdict
from shared.db.models import Result
from shared.results.export import export_results
from shared.results.publish import publish
from shared.results.records import SCHEMA_VERSION
from tests.conftest import HUB_TOKEN
from tests.history import record, runtime

REPO = "supportmatrix/torch-neuronx-model-support"


def test_the_export_is_pushed_once_per_change(session: Session, hub: Any, tmp_path: Path) -> None:
    export = tmp_path / "export"
    rt = runtime("2.21.0+abc", "5.24.0")
    record(session, "Qwen/Qwen3-0.6B", rt, Verdict.PASS)
    export_results(session, export)
    before = len(hub.commits)

    first = publish(export, REPO, HUB_TOKEN)
    assert first.pushed and first.files == 1 and len(hub.commits) == before + 1
    remote = hub.upload_dir / "datasets" / REPO
    [local] = (export / "data").glob("*.parquet")
    assert (remote / "data" / local.name).read_bytes() == local.read_bytes()
    card = (remote / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    config = f"2.21.0-abc--transformers-5.24.0--{rt.stack().name}"  # the versions people look for, then the stack
    assert front["configs"] == [{"config_name": config, "data_files": f"data/{local.name}"}]
    # the card's text says how a config is named, as the YAML names it: by the whole stack
    assert "`<compiler version>--<library>-<library version>--stack-<digest>`" in card
    assert "per compiler version and library version" not in card

    assert not publish(export, REPO, HUB_TOKEN).pushed  # nothing changed: no commit
    assert len(hub.commits) == before + 1

    llama = record(session, "meta-llama/Llama-3.2-1B", runtime("2.22.0+def", "5.24.0"), Verdict.FAIL)
    export_results(session, export)
    second = publish(export, REPO, HUB_TOKEN)
    assert second.pushed and second.files == 2 and len(hub.commits) == before + 2

    # Readers get it back through the ordinary download path.
    path = hf_hub_download(REPO, f"data/{local.name}", repo_type="dataset")
    df = pd.read_parquet(path)
    assert df[df.model_id == "Qwen/Qwen3-0.6B"]["result"].tolist() == ["PASS"]
    assert df.schema_version.tolist() == [SCHEMA_VERSION]

    # A file the full export removes (its key has no results left) leaves the dataset too
    session.execute(sa.delete(Result).where(Result.job_id == llama))
    session.commit()
    assert export_results(session, export).removed
    third = publish(export, REPO, HUB_TOKEN)
    assert third.pushed and third.files == 1
    assert sorted(p.name for p in (remote / "data").iterdir()) == [local.name]


def test_a_push_without_the_write_token_is_refused_and_retried_next_time(
    session: Session, hub: Any, tmp_path: Path
) -> None:
    export = tmp_path / "export"
    record(session, "org/m", runtime("2.21.0+abc", "5.24.0"), Verdict.PASS)
    export_results(session, export)
    with pytest.raises(HfHubHTTPError):
        publish(export, "supportmatrix/other", "wrong-token")
    assert publish(export, "supportmatrix/other", HUB_TOKEN).pushed  # the failed push left nothing marked

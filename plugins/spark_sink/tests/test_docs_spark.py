"""docs/spark.md: every python block runs, in order, against the real cluster and session."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

DOC = Path(__file__).resolve().parents[3] / "docs" / "spark.md"

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("spark")]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_page_shows_batch_stream_and_sink() -> None:
    code = "\n".join(python_blocks(DOC.read_text()))
    assert 'spark.read.format("waltz")' in code
    assert 'spark.readStream.format("waltz")' in code
    assert 'write.format("waltz")' in code and 'writeStream.format("waltz")' in code


def test_the_code_blocks_run_as_written(spark: Any, waltz_cluster: Any, tmp_path: Path) -> None:
    from waltz_spark.testing import high_water_marks

    config = waltz_cluster.spec.client_config()
    before = high_water_marks(config)
    ns: dict[str, Any] = {"spark": spark, "CONFIG": waltz_cluster.client_toml, "tmp": str(tmp_path)}
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 5
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"{DOC.name}[block {i}]", "exec"), ns)
        except Exception as exc:  # name the block that failed
            raise AssertionError(f"docs/spark.md python block {i} failed: {exc!r}\n{block}") from exc
    after = high_water_marks(config)
    # batch write 100 + streaming write 100 + idempotent 50 once (the replay added nothing)
    assert sum(after.values()) - sum(before.values()) == 250
    assert ns["first_run"] == sum(before.values()) + len(before)  # the stream read the whole log as it was
    assert sum(ns["per_partition"].values()) == before[0] + before[1] + 2
    assert ns["counts"]["operations"] >= 0 and ns["balances"].columns == ["account", "balance", "operations"]

"""The DDP benchmark's command line and table, without running it (that takes minutes).

Run the benchmark itself with ``python -m tandem.bench ddp --quick`` (or
``python -m tandem.bench.ddp --quick``); nothing here looks at timings.
"""

from __future__ import annotations

import pytest

from tandem.bench import ddp as bench


def _row(model: str) -> dict:
    lib = {"step": 0.010, "peak": 40 << 20, "params": 8_400_000, "comm": 0.004,
           "overlap": 0.001}
    return {"model": model, "world": 2, "tandem": dict(lib), "torch": {**lib, "step": 0.012,
                                                                      "peak": 44 << 20}}


def test_table_has_a_row_per_model_with_time_and_memory_ratios() -> None:
    lines = bench.format_table([_row("mlp"), _row("cnn")]).splitlines()
    assert lines[0].split()[:3] == ["model", "ranks", "params"]
    mlp = lines[1].split()
    assert mlp[0] == "mlp" and "1.20" in mlp and "1.10" in mlp, lines[1]
    assert bench.format_table([_row("mlp")], markdown=True).startswith("| model |")


def test_unknown_model_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--models", "resnet"])
    assert exc.value.code == 2


def test_models_build_with_the_documented_sizes() -> None:
    mlp, x, _ = bench.build("mlp")
    assert sum(p.numel() for p in mlp.parameters()) == 8 * (1024 * 1024 + 1024)
    assert x.shape == (bench.BATCH, 1024)
    cnn, x, y = bench.build("cnn")
    assert cnn(x).shape == y.shape

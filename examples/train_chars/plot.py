"""The loss curve as a PNG, drawn with matplotlib (the ``example`` extra, which
``scripts/setup.sh`` installs): training loss per step against validation loss."""

from __future__ import annotations

from typing import Sequence

__all__ = ["write_loss_png"]

Point = tuple[float, float]


def write_loss_png(path: str, train: Sequence[Point], val: Sequence[Point] = (),
                   title: str = "train_chars") -> str:
    """Plot (step, loss) points to ``path``; return the renderer's name for the summary."""
    if not train and not val:
        raise ValueError("write_loss_png: nothing to plot")
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed, and none is assumed
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("the loss plot needs matplotlib: run `bash scripts/setup.sh`, or "
                           "`pip install -e '.[example]'`") from exc
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    if train:
        ax.plot(*zip(*train), color="tab:blue", linewidth=1.2, label="train (mean over ranks)")
    if val:
        ax.plot(*zip(*val), "s-", color="tab:red", markersize=5, label="validation")
    ax.set_title(f"{title}: loss per step")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "matplotlib"

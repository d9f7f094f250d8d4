"""PNG plots for the benchmark scripts (matplotlib, no display needed).

Each script writes its pictures next to its tables, by default into docs/images/ (what
docs/benchmarks.md shows); ``--plot-dir ''`` writes none.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on these machines
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

__all__ = ["COLORS", "DEFAULT_DIR", "NullFormatter", "add_plot_argument", "new_figure", "plain_numbers", "save"]

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "docs" / "images"
COLORS = {"shoal": "#2563eb", "hf-serial": "#9ca3af", "hf-padded": "#db7706", "hf-cb": "#16a34a", "floor": "#111827"}


def add_plot_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plot-dir", default=str(DEFAULT_DIR),
                        help=f"where the PNG plots go (default {DEFAULT_DIR}; '' for none)")


def new_figure(width: float = 7.0, height: float = 3.6, columns: int = 1) -> tuple[Figure, list]:  # type: ignore[type-arg]
    figure, axes = plt.subplots(1, columns, figsize=(width, height), squeeze=False)
    return figure, list(axes[0])


def plain_numbers() -> FuncFormatter:
    """Tick labels as plain numbers (0.1, 1, 1000), not powers of ten, on log axes too."""
    return FuncFormatter(lambda value, _: f"{value:g}")


def save(figure: Figure, plot_dir: str, name: str, caption: str) -> Path | None:
    """Write `figure` as ``<plot_dir>/<name>.png`` (with `caption` under it); None if plots are off."""
    if not plot_dir:
        plt.close(figure)
        return None
    path = Path(plot_dir) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.text(0.5, 0.005, caption, ha="center", va="bottom", fontsize=7, color="#6b7280")
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    print(f"plot: {path}", flush=True)
    return path

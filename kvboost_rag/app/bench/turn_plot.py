"""The per-turn figure the multi-turn benchmarks share: TTFT by turn (log scale) beside a reuse share by turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def finish_turn_figure(fig: Any, ax: Any, bx: Any, *, xlabel: str, share_label: str, title: str,
                       path: str) -> None:
    """Label the two axes (``ax``: TTFT, ``bx``: ``share_label`` in [0, 1]), title the figure, save it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("TTFT, median over conversations (s)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    bx.set_xlabel("turn")
    bx.set_ylabel(share_label)
    bx.set_ylim(0, 1.02)
    bx.grid(True, alpha=0.3)
    bx.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)

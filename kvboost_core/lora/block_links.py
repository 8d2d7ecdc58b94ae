"""Link slots after each document (KVLink-style), for a block adapter that restores cross-document attention.

A block-attention prompt reads each document as it was encoded alone. Link slots are ``n`` extra positions
right after every placed document, computed in the main pass (so they attend to everything before them, other
documents included) from a small trained table of input embeddings, the same ``n`` vectors after every
document. What follows a document then reads both the document's own KV and its links' summary of the context.
They add ``n`` tokens per document to the prompt.

Here: the prompt transformation (ids and runs with the slots inserted) and the table. The HF block construction
(:mod:`kvboost_core.lora.block_prefill`) computes slot runs from the table's rows; that is the training forward and
the independent reference. Serving them in the engine is not built yet: adapters with links are measured through
the HF construction only (issue #32).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from kvboost_core.lora.block_prefill import Run

LINKS_FILE = "links.safetensors"  # beside block.safetensors; kvboost_core.lora.block_adapter refuses to serve past it
LINKS_KEY = "links.table"


def insert_links(ids: Sequence[int], runs: Sequence[Run], n: int, fill_id: int) -> tuple[list[int], list[Run]]:
    """``ids`` and ``runs`` with ``n`` link slots (placeholder id ``fill_id``) after every document run; the
    positions of everything after a slot move up by the slots before it."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n == 0:
        return list(ids), list(runs)
    out_ids: list[int] = []
    out_runs: list[Run] = []
    shift = 0
    covered = 0
    for r in runs:
        out_ids += ids[r.start: r.end]
        out_runs.append(Run(r.start + shift, r.end + shift, r.doc, r.offset, r.link))
        covered = r.end
        if r.doc is not None:
            out_runs.append(Run(r.end + shift, r.end + shift + n, None, 0, True))
            out_ids += [fill_id] * n
            shift += n
    out_ids += ids[covered:]
    return out_ids, out_runs


def shift_of(runs: Sequence[Run], n: int) -> int:
    """How many slots :func:`insert_links` puts before the end of ``runs`` (n per document run)."""
    return n * sum(r.doc is not None for r in runs)


class LinkTable(nn.Module):
    """``n`` trainable input embeddings (n, d), started from a token's embedding plus small noise."""

    def __init__(self, model: nn.Module, n: int, init_id: int, seed: int = 0) -> None:
        super().__init__()
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        emb = model.get_input_embeddings().weight  # type: ignore[operator]
        g = torch.Generator().manual_seed(seed)
        base = emb[init_id].detach().float().cpu()
        noise = torch.randn(n, base.shape[0], generator=g) * base.std() * 0.1
        self.table = nn.Parameter((base.expand(n, -1) + noise).to(emb.device))

    @property
    def n(self) -> int:
        return int(self.table.shape[0])

    def forward(self) -> torch.Tensor:
        return self.table


def save_table(directory: str, table: torch.Tensor) -> None:
    """Write the link table (n, d) as ``links.safetensors`` in an adapter directory."""
    from safetensors.torch import save_file

    save_file({LINKS_KEY: table.detach().float().cpu().contiguous()}, os.path.join(directory, LINKS_FILE))


def load_table(directory: str, device: str | torch.device = "cpu") -> torch.Tensor:
    """The link table (n, d) saved in an adapter directory; a clear error for a missing or foreign file."""
    from safetensors.torch import load_file

    path = os.path.join(directory, LINKS_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{directory!r} has no link table ({LINKS_FILE})")
    tensors = load_file(path)
    if LINKS_KEY not in tensors or tensors[LINKS_KEY].dim() != 2:
        raise ValueError(f"{path!r} holds no (n, d) {LINKS_KEY!r} table")
    return tensors[LINKS_KEY].float().to(device)

"""One resumable training loop for the adapters' distillation (``kvboost-rag adapt``, ``adapt --block``).

AdamW on the given parameters, cosine schedule with 5% warm-up, gradient clipping at 1.0, one sample a step in a
seeded order. A checkpoint (``train.pt``: parameters, optimizer, step, losses and the CPU seconds spent) is
written every ``every`` steps and at the end; a run started again with the same arguments resumes from it and
reaches the same state as one never interrupted (the order depends on the seed only). ``cpu_minutes`` stops a
run once the process has spent that much CPU time training, so runs of one budget curve are comparable on a
shared machine (the x axis is CPU time, not wall time); the cosine decay then follows the larger of the step
and CPU-time fractions, so a budgeted run ends with its learning rate decayed. ``wall_minutes`` is the same
budget in wall time, for a GPU, where CPU time does not measure the work (both are summed over stretches and kept
in the checkpoint). Under a budget the warm-up also follows the budget's fraction, so a run with a generous
``steps`` still warms up over the first 5% of its budget.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class TrainState:
    step: int = 0
    losses: list[float] = field(default_factory=list)
    cpu_s: float = 0.0  # CPU seconds spent in training steps, over all stretches
    wall_s: float = 0.0  # wall seconds spent in training steps, over all stretches
    log: list[dict[str, float]] = field(default_factory=list)  # one row per checkpoint


def schedule(step: int, steps: int, lr: float, progress: float | None = None) -> float:
    """Linear warm-up over the first 5% of the run, then cosine decay. The run's fraction done is
    ``step / steps``, or ``progress`` (a budget's fraction spent) where that is larger."""
    warmup = max(1, steps // 20)
    frac = step / steps if progress is None else min(1.0, max(progress, step / steps))
    return lr * min(1.0, (frac * steps + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * frac))


def budget_progress(st: TrainState, cpu_minutes: float | None, wall_minutes: float | None) -> float | None:
    """The larger fraction spent of the CPU and wall-time budgets given (None without a budget)."""
    fracs = [spent / (budget * 60) for spent, budget in ((st.cpu_s, cpu_minutes), (st.wall_s, wall_minutes))
             if budget is not None]
    return max(fracs) if fracs else None


def order(n: int, steps: int, seed: int) -> list[int]:
    """The sample index of every step: whole shuffled passes over ``n`` samples."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < steps:
        perm = list(range(n))
        rng.shuffle(perm)
        out += perm
    return out[:steps]


def train(params: Sequence[Any], n_samples: int, loss_at: Callable[[int], Any], *, steps: int, lr: float,
          seed: int, ckpt: str | None = None, every: int = 20, cpu_minutes: float | None = None,
          minutes: float | None = None, wall_minutes: float | None = None,
          state_dict: Callable[[], dict[str, Any]] | None = None,
          load_state_dict: Callable[[dict[str, Any]], None] | None = None, desc: str = "training",
          log: Any = print) -> TrainState:
    """Minimise ``loss_at(i)`` (sample i's differentiable loss) over ``steps`` steps (``minutes``: also stop after
    this much wall time in this stretch; ``wall_minutes``: a wall-time budget over all stretches, which the
    schedule follows like ``cpu_minutes``). ``state_dict`` /
    ``load_state_dict`` save and restore the trained weights with the checkpoint."""
    import torch
    from tqdm import tqdm

    if steps < 1 or n_samples < 1:
        raise ValueError(f"steps and n_samples must be >= 1, got {steps} and {n_samples}")
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a number > 0, got {lr!r}")
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    st = TrainState()
    if ckpt and os.path.isfile(ckpt):
        try:
            raw = torch.load(ckpt, weights_only=False)
            if load_state_dict is not None:
                load_state_dict(raw["weights"])
            opt.load_state_dict(raw["opt"])
            st = TrainState(step=int(raw["step"]), losses=list(raw["losses"]), cpu_s=float(raw["cpu_s"]),
                            wall_s=float(raw.get("wall_s", 0.0)), log=list(raw["log"]))
        except Exception as exc:  # noqa: BLE001 - a corrupt checkpoint names itself, never a silent restart
            raise ValueError(f"corrupt training checkpoint {ckpt}: {exc}; delete it to start over") from exc
        log(f"resuming at step {st.step}/{steps} ({st.cpu_s / 60:.1f} CPU-min spent)")
    plan = order(n_samples, steps, seed)
    bar = tqdm(range(st.step, steps), desc=desc, initial=st.step, total=steps, mininterval=30)

    def save() -> None:
        if not ckpt:
            return
        st.log.append({"step": st.step, "cpu_min": round(st.cpu_s / 60, 2), "wall_min": round(st.wall_s / 60, 2),
                       "loss": statistics.fmean(st.losses[-every:]) if st.losses else float("nan")})
        tmp = ckpt + ".tmp"
        torch.save({"weights": state_dict() if state_dict else {}, "opt": opt.state_dict(), "step": st.step,
                    "losses": st.losses, "cpu_s": st.cpu_s, "wall_s": st.wall_s, "log": st.log}, tmp)
        os.replace(tmp, ckpt)

    w0 = time.perf_counter()
    for step in bar:
        if cpu_minutes is not None and st.cpu_s >= cpu_minutes * 60:
            log(f"CPU budget of {cpu_minutes} min reached at step {step}")
            break
        if wall_minutes is not None and st.wall_s >= wall_minutes * 60:
            log(f"wall-time budget of {wall_minutes} min reached at step {step}")
            break
        if minutes is not None and time.perf_counter() - w0 >= minutes * 60:
            log(f"{minutes} min of wall time reached at step {step} (this stretch)")
            break
        c0, t0 = time.process_time(), time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = schedule(step, steps, lr, budget_progress(st, cpu_minutes, wall_minutes))
        loss = loss_at(plan[step])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        st.losses.append(float(loss.detach()))
        st.step = step + 1
        st.cpu_s += time.process_time() - c0
        st.wall_s += time.perf_counter() - t0
        bar.set_postfix(loss=f"{statistics.fmean(st.losses[-20:]):.4f}", cpu_min=f"{st.cpu_s / 60:.1f}")
        if st.step % every == 0:
            save()
    save()
    for p in params:
        p.requires_grad_(False)
    return st

"""The ``server`` method of :mod:`kvboost_rag.app.bench.chat_turns`: ``kvboost-rag serve`` in a subprocess on a
free loopback port (bounded start, stopped by its PID), one chat at a time through the official ``openai``
client, streamed, TTFT to the first content chunk; the server's chat backfill awaited through ``/health``."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@contextmanager
def serve(model: str, threads: int, start_timeout: float = 600.0) -> Iterator[tuple[str, int]]:
    """``kvboost-rag serve`` on a free loopback port: (base URL, PID); stopped by its PID on exit."""
    from kvboost_rag.app.server.launch import launched

    with launched(["--model", model, "--threads", str(threads)], start_timeout=start_timeout,
                  stop_timeout=30) as (url, proc):
        yield url, proc.pid


def _backfill_health(url: str) -> dict[str, Any]:
    import httpx

    return dict(httpx.get(url + "/health", timeout=30).json()["backfill"])


def _await_server_backfill(url: str, done_before: int, timeout: float = 3600.0) -> None:
    """Until the server has no backfill pending and this turn's job was taken (or none came within 2 s)."""
    start = time.monotonic()
    while True:
        h = _backfill_health(url)
        done = h["jobs"] + h["superseded"] + h["dropped"] + h["failed"]
        if not h["pending"] and (done > done_before or time.monotonic() - start > 2.0):
            return
        if time.monotonic() - start > timeout:
            raise RuntimeError("the server's backfill did not finish within an hour")
        time.sleep(0.05)


def server_conversation(url: str, pid: int, model: str, refs: list[dict[str, Any]], think: str
                        ) -> list[dict[str, Any]]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    out = []
    for ref in refs:
        h0 = _backfill_health(url)
        t0 = time.perf_counter()
        stream = client.chat.completions.create(model=model, messages=ref["messages"], stream=True,  # type: ignore[arg-type]
                                                max_tokens=len(ref["tokens"]), temperature=0,
                                                stream_options={"include_usage": True})
        ttft, text, usage = None, "", None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage
        if ttft is None or usage is None:
            raise RuntimeError("the server's stream had no content or no usage")
        if usage.prompt_tokens != len(ref["ids"]):
            raise RuntimeError(f"prompt drift: the server counted {usage.prompt_tokens} prompt tokens, HF's "
                               f"chat template gives {len(ref['ids'])}")
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        row: dict[str, Any] = {"ttft_s": ttft, "exact": (cached or 0) / usage.prompt_tokens,
                               "same_answer": text.strip() == ref["text"].strip(), "backfill_cpu_s": None}
        if think == "backfill":
            cpu0 = _proc_cpu(pid)
            _await_server_backfill(url, h0["jobs"] + h0["superseded"] + h0["dropped"] + h0["failed"])
            row["backfill_cpu_s"] = _proc_cpu(pid) - cpu0
        out.append(row)
    _await_server_backfill(url, -1)  # the last turn's backfill, off the clock
    h1 = _backfill_health(url)
    out[-1]["backfill_total_wall_s"] = h1["seconds"]  # the server's slices, all turns so far
    return out

"""KVBoostLLM: a LangChain completion LLM over kvboost_rag.KVBoostRAG.

Drop it in where HuggingFacePipeline goes; chains keep formatting prompts as they always do, and documents
warmed with ``warm_documents`` are found inside those prompts and their KV reused (transparent mode).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.llms import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from langchain_core.runnables.config import run_in_executor

from langchain_kvboost._base import KVBoostFields, aiter_in_thread

_INFO_KEYS = ("ttft_s", "reuse_ratio", "doc_tokens", "doc_tokens_reused", "doc_tokens_kept", "doc_tokens_recomputed", "documents",
              "prompt_tokens", "output_tokens", "finish_reason", "mode")


def _info(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: stats[k] for k in _INFO_KEYS if k in stats}


class KVBoostLLM(KVBoostFields, BaseLLM):
    """Completion LLM with position-independent KV reuse of warmed documents.

    Example:
        ```python
        llm = KVBoostLLM.from_model_id("Qwen/Qwen2.5-0.5B-Instruct", max_tokens=128)
        llm.warm_documents(docs)          # once, e.g. at indexing time
        chain.invoke({"input": "..."})    # any chain; prompts containing the docs reuse their KV
        llm.last_stats["doc_tokens_reused"]
        ```
    """

    @property
    def _llm_type(self) -> str:
        return "kvboost"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._params()

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids from the model's own tokenizer (not LangChain's GPT-2 default)."""
        return self.rag.token_ids(text)

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        opts = self._call_options(stop, kwargs)
        generations = []
        prompt_tokens = completion_tokens = 0
        for prompt in prompts:
            result = self.rag.generate(prompt, **opts)
            generations.append([Generation(text=result.text, generation_info=_info(result.stats))])
            prompt_tokens += len(result.prompt_token_ids)
            completion_tokens += len(result.token_ids)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        return LLMResult(generations=generations, llm_output={"token_usage": usage, "model_name": self.model_name})

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        # Generation is blocking compute: run it in a worker thread so the event loop stays free.
        return await run_in_executor(None, self._generate, prompts, stop,
                                     run_manager.get_sync() if run_manager else None, **kwargs)

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        for piece in self.rag.stream(prompt, **self._call_options(stop, kwargs)):
            chunk = GenerationChunk(text=piece)
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=_info(self.rag.last_stats))

    async def _astream(self, prompt: str, stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        opts = self._call_options(stop, kwargs)
        async for piece in aiter_in_thread(lambda: self.rag.stream(prompt, **opts)):
            chunk = GenerationChunk(text=piece)
            if run_manager:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=_info(self.rag.last_stats))

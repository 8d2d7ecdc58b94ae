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

from kvboost_core import GenerationResult
from kvboost_rag.adapter import call_info, openai_finish_reason
from langchain_kvboost._base import KVBoostFields, aiter_in_thread


def _generation_info(result: GenerationResult | None) -> dict[str, Any]:
    """A completion's generation_info: ``finish_reason`` in OpenAI's words ("stop"/"length"), then the
    call's own figures (:func:`kvboost_rag.adapter.call_info`, the engine's reason as
    ``engine_finish_reason``)."""
    return {"finish_reason": openai_finish_reason(result), **call_info(result)}


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
            generations.append([Generation(text=result.text, generation_info=_generation_info(result))])
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
        done: dict[str, Any] = {}
        for piece in self.rag.stream(prompt, on_result=_keeper(done), **self._call_options(stop, kwargs)):
            chunk = GenerationChunk(text=piece)
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        # this stream's own result, not last_stats: another call may have finished in between
        yield GenerationChunk(text="", generation_info=_generation_info(done.get("result")))

    async def _astream(self, prompt: str, stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        opts = self._call_options(stop, kwargs)
        done: dict[str, Any] = {}
        async for piece in aiter_in_thread(lambda: self.rag.stream(prompt, on_result=_keeper(done), **opts)):
            chunk = GenerationChunk(text=piece)
            if run_manager:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=_generation_info(done.get("result")))


def _keeper(done: dict[str, Any]) -> Any:
    """An ``on_result`` callback keeping a stream's own result and stats in ``done``."""
    def keep(result: GenerationResult, stats: dict[str, Any]) -> None:
        done["result"], done["stats"] = result, stats

    return keep

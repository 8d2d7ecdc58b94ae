"""The model as kvboost runs it: the code that drives a HuggingFace decoder's own modules.

- :mod:`.driver`: the decoder run layer by layer for a chosen subset of positions (the only model-specific module);
- :mod:`.attention`: the attention function kvboost registers (sparse query rows at their causal cost, row-wise
  decode);
- :mod:`.forward`: the planned forward pass, each layer run only for the positions a repair schedule computes;
- :mod:`.lean`: one decode step of a Llama-shaped decoder without the HF module stack, bitwise the planned
  forward's (generation uses it where it applies);
- :mod:`.replay`: the check layer's Q/K/V projections reused for the rows it keeps;
- :mod:`.slices`: a long model call run in slices that pause between two layers (the server's warms); its pause
  points sit in the forward's layer loop, so it lives beside it;
- :mod:`.weights`: the precision the linear layers' weights are held and read at.

Imports: of kvboost_core, only the leaves :mod:`kvboost_core.rope` and :mod:`kvboost_core.config`. The cache
pipeline, :mod:`kvboost_core.lora`, :mod:`kvboost_core.tuning`, :mod:`kvboost_core.serving` and the engine shell
(:mod:`kvboost_core.engine`) stand on it, never the other way round (``tests/test_layout.py``).
"""

"""Measuring and choosing the repair settings: :mod:`.fidelity` (reuse against full prefill: logits, KL, top-1,
answers), :mod:`.calibrate` (the cheapest CacheBlend setting that meets a KL target) and :mod:`.autocalib`
(calibration on first use, cached per model).

Imports: the flat modules, :mod:`kvboost_core.model` and :mod:`kvboost_core.lora`; the engine only as
:class:`kvboost_core.stages.EngineStages`, never the engine shell or :mod:`kvboost_core.serving`. In kvboost_core
only the engine shell imports this package (``tests/test_layout.py``).
"""

"""Measuring and choosing the repair settings: :mod:`.fidelity` (reuse against full prefill: logits, KL, top-1,
answers), :mod:`.calibrate` (the cheapest CacheBlend setting that meets a KL target) and :mod:`.autocalib`
(calibration on first use, cached per model)."""

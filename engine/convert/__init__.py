"""The EXL3 converter: an HF model directory in, an EXL3 model directory out. Offline only:
loading and running a model needs nothing here (the format at run time is :mod:`engine.exl3`).

:func:`engine.convert.pipeline.convert_model` is the whole job, a step per module:

- :mod:`~engine.convert.options`: :class:`~engine.convert.options.ConvertOptions`, checked when made;
  :mod:`~engine.convert.errors`: :class:`~engine.convert.errors.ConvertError`.
- :mod:`~engine.convert.source_model`: the unquantized model, one decoder block at a time;
  :mod:`~engine.convert.slots`: each block's quantizable linears.
- :mod:`~engine.convert.calibration_rows`: the calibration token rows (the text in
  ``calibration/``; :mod:`~engine.convert.self_calibration`: rows the model writes itself).
- :mod:`~engine.convert.host_states`: where the calibration hidden states live.
- :mod:`~engine.convert.block_runner`: a block run over calibration rows;
  :mod:`~engine.convert.hessians`: its linears' input Hessians.
- :mod:`~engine.convert.bit_plan`: the bits per linear, from the
  :mod:`~engine.convert.sensitivity` pre-pass and :mod:`~engine.convert.allocation`.
- :mod:`~engine.convert.block_quantizer`: a block's linears quantized with
  :mod:`~engine.convert.quantize` (LDLQ over :mod:`~engine.convert.ldl`, the tail-biting
  :mod:`~engine.convert.viterbi` encoder, the :mod:`~engine.convert.refit` of the scales) and
  optionally their scales tuned (:mod:`~engine.convert.finetune`).
- :mod:`~engine.convert.head`: the output head.
- :mod:`~engine.convert.checkpoints`: the work directory (finished blocks, resume).
- :mod:`~engine.convert.output`: the output directory in the reference layout.

:mod:`~engine.convert.mse` measures the encoder's error per K (``python -m engine.convert.mse``).
Modules import each other in one direction (no cycles): the pipeline on top, the step modules
below it, the quantizer and the :mod:`engine.exl3` format at the bottom.
"""

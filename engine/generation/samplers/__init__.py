"""Host-only sampling processors beyond the OpenAI set, one per module: DRY, XTC, top-n-sigma,
typical-p, and the token bans that banned strings leave after a rewind.

Each exposes one batched ``apply(x, batch)`` over float32 ``[rows, vocab]`` logits, registered as
a :class:`~engine.generation.sampling.Processor` in :mod:`engine.generation.sampling` (the one
reference sampler). None has a GPU kernel yet: a step with any of them active samples its rows on
the host (``engine.generation.device_sampling.sampling_path``).
"""

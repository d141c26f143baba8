"""Measurement tools: benchmarks, profilers and acceptance runs. Not part of the runtime.

Each module here is one ``python -m engine`` verb (``bench``, ``bench-kernels``, ``profile-step``,
``quality`` ...) and can also run alone as ``python -m engine.bench.<module>`` on a machine that
has only the inference dependencies. They time, compare and report; the library they measure
(``engine.session``, ``engine.generation``, the app) never imports this package, and
``tests/test_layering.py`` keeps it so.

The command line knows the verbs from :data:`VERBS` alone and imports a module only when its verb
runs: these modules pull in torch (and some transformers) at import time, which ``--help`` and the
user-facing commands must not pay for.
"""

from __future__ import annotations

from typing import NamedTuple


class Verb(NamedTuple):
    name: str  # the subcommand, as typed
    module: str  # the module whose ``register(subparsers)`` adds its parser
    help: str  # its line in ``python -m engine --help``


# Order is the order in --help.
VERBS: tuple[Verb, ...] = (
    Verb("bench", "engine.bench.speed", "prefill/decode speed vs transformers in the same run"),
    Verb(
        "synthetic",
        "engine.bench.synthetic",
        "write a random-weight EXL3 model of a published shape (for benchmarks)",
    ),
    Verb("bench-kernels", "engine.bench.kernels", "EXL3 GEMV/GEMM kernels vs cuBLAS fp16 (GPU)"),
    Verb(
        "bench-attention",
        "engine.bench.attention",
        "paged decode attention (dense / 2-8 bit cache) vs SDPA (GPU)",
    ),
    Verb("bench-sampler", "engine.bench.sampler", "host-side sampler time per token vs its plain definition"),
    Verb(
        "bench-device-sampler",
        "engine.bench.device_sampler",
        "GPU sampling kernel vs host sampler vs torch reference",
    ),
    Verb(
        "profile-step", "engine.bench.profile_step", "kernel time breakdown of a prefill and of decode steps"
    ),
    Verb(
        "convert-bench",
        "engine.bench.conversion",
        "time of the EXL3 converter, per stage, on a published shape",
    ),
    Verb(
        "quality",
        "engine.bench.quality",
        "perplexity and KL of EXL3 and GGUF quantizations of a model against itself",
    ),
    Verb(
        "constrain-eval",
        "engine.bench.constrain_eval",
        "acceptance run for constrained output (validity, overhead, errors)",
    ),
    Verb(
        "bench-serve",
        "engine.bench.serve",
        "requests/s and tok/s of the OpenAI-compatible server vs the engine directly",
    ),
)


def help_for(name: str) -> str:
    """The help line of verb ``name`` (each module registers its parser with it, so the line in
    ``--help``, shown before the module is imported, and the parser's own agree)."""
    for verb in VERBS:
        if verb.name == name:
            return verb.help
    raise KeyError(name)

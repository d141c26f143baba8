"""ExLlamaV3, the peer, measured beside us (a development tool; nothing in the engine imports it).

ExLlamaV3 is on PyPI as a pure-Python wheel carrying its CUDA sources, built on first import. Its
build takes ~20 min on 2 cores, so build it ahead of time where compile time is free and carry the
module (23 MB, 15 MB gzipped for sm_90) to the GPU machine, as with our own extension:

  build   python tools/peer_exllamav3.py build SRC_DIR OUT_DIR
          SRC_DIR: an unpacked wheel (the folder holding ``exllamav3/``); run it with the GPU
          machine's torch (there: torch 2.11 + CUDA 13) and TORCH_CUDA_ARCH_LIST=9.0. Headers that
          torch includes but the CUDA toolkit here lacks (cuBLAS, cuSPARSE, cuSOLVER) are taken
          from the torch venv's ``nvidia/cu13/include`` (``--extra-include``), searched after the
          toolkit's own.
  decode  python tools/peer_exllamav3.py decode MODEL_DIR [--json OUT]
          with ``exllamav3_ext.so`` and the unpacked package (and its runtime dependencies) on
          PYTHONPATH: batch-1 greedy decode speed (new tokens / its own generate time) after an
          8-token prompt and after a 4,096-token one, three runs each, and that prompt's prefill
          speed, from the job results of its ``Generator``.
  load    python tools/peer_exllamav3.py load MODEL_DIR [--device cpu]
          whether ExLlamaV3 reads a directory (ours: ``engine convert`` or ``engine synthetic``):
          its config, every tensor into its modules (on the CPU too: no kernel runs), and how many
          linears it took as EXL3.

Compare with ``python -m engine bench -m MODEL_DIR --device cuda --no-peer --decode-tokens 256
--prompt 4096 --context 4096`` on the same directory (docs/PERFORMANCE.md has both sides).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path


def build(src: Path, out: Path, extra_include: list[str]) -> None:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, load

    flags_path = src / "exllamav3" / "util" / "cuda_flags.py"
    spec = importlib.util.spec_from_file_location("exllamav3_cuda_flags", flags_path)
    flags = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flags)  # standard library only, by its own design
    sources_dir = src / "exllamav3" / "exllamav3_ext"
    isystem = [a for inc in extra_include for a in ("-isystem", inc)]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    load(
        name="exllamav3_ext",
        sources=flags.extension_sources(str(sources_dir)),
        extra_include_paths=[str(sources_dir)],
        extra_cflags=["-Ofast", *isystem],
        extra_cuda_cflags=flags.cuda_cflags(cuda_home=CUDA_HOME, debug=False, hip=False) + isystem,
        build_directory=str(out),
        verbose=True,
    )
    print(f"built {out / 'exllamav3_ext.so'} in {time.perf_counter() - t0:.0f} s (torch {torch.__version__})")


def decode(model_dir: Path, json_out: str | None) -> None:
    import torch
    from exllamav3 import Cache, Config, Generator, Job, Model, Tokenizer
    from exllamav3.generator.sampler import ArgmaxSampler

    config = Config.from_directory(str(model_dir))
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=8192)
    model.load()
    generator = Generator(model=model, cache=cache, tokenizer=Tokenizer.from_config(config))
    gen = torch.Generator().manual_seed(0)

    def run(prompt: int, new: int) -> dict:
        ids = torch.randint(100, 40000, (1, prompt), generator=gen)
        generator.enqueue(Job(input_ids=ids, max_new_tokens=new, stop_conditions=[], sampler=ArgmaxSampler()))
        last = {}
        while generator.num_remaining_jobs():
            for result in generator.iterate():
                if result.get("eos"):
                    last = result
        return last

    run(16, 32)  # warm-up
    rows = []
    for prompt in (8, 4096):
        for _ in range(3):
            r = run(prompt, 256)
            rows.append(
                {
                    "prompt_tokens": r["prompt_tokens"],
                    "new_tokens": r["new_tokens"],
                    "decode_tok_s": r["new_tokens"] / r["time_generate"],
                    "prefill_tok_s": r["prompt_tokens"] / max(r["time_prefill"], 1e-9),
                }
            )
            print(rows[-1], flush=True)
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=1))


def load(model_dir: Path, device: str) -> None:
    from exllamav3 import Config, Model

    config = Config.from_directory(str(model_dir))
    model = Model.from_config(config)
    model.load(device=device)
    kinds: dict[str, int] = {}
    for module in model.modules:
        for sub in module:
            kind = getattr(sub, "quant_type", None)
            if kind:
                kinds[kind] = kinds.get(kind, 0) + 1
    print(f"{model_dir}: {config.architecture} loaded on {device}; linears by storage: {kinds}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("src", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument("--extra-include", action="append", default=[])
    d = sub.add_parser("decode")
    d.add_argument("model", type=Path)
    d.add_argument("--json")
    ld = sub.add_parser("load")
    ld.add_argument("model", type=Path)
    ld.add_argument("--device", default="cpu")
    args = p.parse_args()
    if args.cmd == "load":
        load(args.model, args.device)
    elif args.cmd == "build":
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            p.error("set TORCH_CUDA_ARCH_LIST (e.g. 9.0): there may be no GPU here to take it from")
        build(args.src, args.out, args.extra_include)
    else:
        decode(args.model, args.json)


if __name__ == "__main__":
    main()

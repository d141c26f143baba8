"""How often constrained JSON output is valid when the token budget is tight (not a CI test).

    python tools/constrain_budget.py -m MODEL_DIR --seeds 12 --max-new-tokens 200 60 --schema recipe

Runs ``--seeds`` sampled generations (temperature 1.0, one seed each) per schema and budget,
checks each reply with ``jsonschema`` and prints valid / incomplete / error counts; with
``--starter`` instead of ``-m`` it imports the bundled SmolLM2-135M first. A kbnf panic (or any
other engine failure) is counted under "error" with its message, it does not stop the run.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

RECIPE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 60},
        "servings": {"type": "integer", "minimum": 1, "maximum": 12},
        "ingredients": {
            "type": "array",
            "items": {"type": "string", "maxLength": 80},
            "minItems": 1,
            "maxItems": 8,
        },
        "steps": {
            "type": "array",
            "items": {"type": "string", "maxLength": 160},
            "minItems": 1,
            "maxItems": 8,
        },
    },
    "required": ["name", "servings", "ingredients", "steps"],
}
RECIPE_PROMPT = "Write a recipe for pancakes as JSON: name, servings, ingredients and steps."


def schemas() -> dict[str, tuple[str, dict[str, Any]]]:
    from engine.bench.constrain_eval import SCHEMAS

    out = {"recipe": (RECIPE_PROMPT, RECIPE)}
    for name, prompt, schema in SCHEMAS:
        out["s" + name.split()[0]] = (prompt, schema)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default=None, help="model directory (default: the starter model)")
    p.add_argument("--models-dir", default="/tmp/trellis-models", help="where --model-less runs import it")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seeds", type=int, default=12)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--temperature", type=float, nargs="+", default=[1.0])
    p.add_argument("--max-new-tokens", type=int, nargs="+", default=[200])
    p.add_argument("--schema", nargs="+", default=["recipe"])
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--show", type=int, default=2, help="failures printed per case")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    import jsonschema

    from engine.generation import constraints
    from engine.generation.job import Job
    from engine.generation.sampling import SamplingSettings
    from engine.session import ChatSession

    model = args.model
    if model is None:
        from engine.starter import ensure_starter_model

        model = ensure_starter_model(Path(args.models_dir))
    session = ChatSession.load(model, device=args.device, cache_tokens=8192)
    session.generator.max_batch_size = args.batch
    table = schemas()
    report = []
    for name in args.schema:
        prompt, schema = table[name]
        constraint = constraints.json_schema(schema)
        ids = session.tokenizer.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
        for budget in args.max_new_tokens:
            for temperature in args.temperature:
                seeds = range(args.first_seed, args.first_seed + args.seeds)
                jobs = [
                    Job(ids, budget, SamplingSettings(temperature=temperature, seed=s), constraint=constraint)
                    for s in seeds
                ]
                t = time.perf_counter()
                results = []
                for i in range(0, len(jobs), args.batch):
                    results += session.generator.generate(jobs[i : i + args.batch])
                elapsed = time.perf_counter() - t
                counts: collections.Counter[str] = collections.Counter()
                failures = []
                for seed, r in zip(seeds, results):
                    try:
                        if r.error:
                            raise ValueError(r.error)
                        jsonschema.validate(json.loads(r.text), schema)
                        counts["valid"] += 1
                    except Exception as exc:  # noqa: BLE001 - every failure is counted
                        kind = "incomplete" if "incomplete" in str(exc) else "error"
                        counts[kind] += 1
                        why = str(exc)[:300]
                        failures.append({"seed": seed, "stop": r.stop_reason, "why": why, "text": r.text})
                tokens = sum(r.new_tokens for r in results) / max(len(results), 1)
                row = {
                    "schema": name,
                    "max_new_tokens": budget,
                    "temperature": temperature,
                    "seeds": len(results),
                    **{k: counts[k] for k in ("valid", "incomplete", "error")},
                    "mean_new_tokens": round(tokens, 1),
                    "seconds": round(elapsed, 1),
                    "failures": failures,
                }
                report.append(row)
                print(
                    f"{name:7s} budget {budget:4d} T {temperature:3.1f}"
                    f"  valid {counts['valid']:3d}/{len(results)}"
                    f"  incomplete {counts['incomplete']:3d}  error {counts['error']:3d}"
                    f"  mean tokens {tokens:6.1f}  {elapsed:6.1f} s",
                    flush=True,
                )
                for f in failures[: args.show]:
                    print(f"    seed {f['seed']} {f['stop']}: {f['why'][:160]!r}\n      {f['text'][-160:]!r}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train the tiny hybrid checkpoints in tests/data/tiny-hybrids/ (a Qwen3.5 and a NemotronH).

    python tools/train_tiny_hybrid.py [--only qwen3_5|nemotron_h] [--steps 800] [--threads 1]

Each model is built with transformers' own classes (random init, fixed seed), with the EXL3
fixture's tokenizer (a 2048-entry byte-level BPE, shared/fixtures/exl3/tiny-llama-hf), and trained
with AdamW on CPU, as that fixture's tiny Llama was: structured weights and activations, so that a
quantization's perplexity cost means what it means on a real model (a random model's perplexity is
~its vocabulary whatever the weights). Saved as fp16 safetensors with its config and tokenizer
files, and ``training.json`` (texts, steps, loss curve, time).

The three texts are disjoint, so that the conversion test (tests/convert/
test_hybrid_conversion_quality.py) measures on text neither training nor calibration saw:

- training: the English files of the converter's calibration folder (TRAIN_FILES);
- calibration: the converter's default, that whole folder (a real model's calibration text is
  likewise the kind of text it was trained on);
- evaluation: tests/data/public_domain.txt, in no calibration file (calibration/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION = ROOT / "engine" / "convert" / "calibration"
# English text (the tokenizer's language): prose, documents, chats and tutorials.
TRAIN_FILES = (
    "conversations.txt",
    "documents.txt",
    "encyclopedic.txt",
    "essays.txt",
    "fiction.txt",
    "fiction_long.txt",
    "instructions.txt",
    "prose_en.txt",
    "tech_tutorials.txt",
    "web.txt",
)
EVAL_TEXT = ROOT / "tests" / "data" / "public_domain.txt"
OUT = ROOT / "tests" / "data" / "tiny-hybrids"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VOCAB, BOS, EOS = 2048, 1, 2


def tokenizer_dir() -> Path:
    """The fixture's tiny Llama, whose tokenizer the models share (tests/support/fixture_paths)."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from fixture_paths import exl3_fixture_dir

    found = exl3_fixture_dir()
    if found is None:
        raise SystemExit("error: the EXL3 fixtures (shared/fixtures/exl3) are needed for their tokenizer")
    return found / "tiny-llama-hf"


def qwen3_5_config():
    """Three gated delta nets then one gated attention layer, the 3:1 rhythm of Qwen3.5."""
    import transformers as tf

    return tf.Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )


def nemotron_h_config():
    """Mamba-2, squared-ReLU MLP and attention blocks in Nemotron-H's ``M-M*-`` kind of pattern."""
    import transformers as tf

    return tf.NemotronHConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        layers_block_type=["mamba", "mlp", "mamba", "attention", "mlp"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=1,
        ssm_state_size=32,
        conv_kernel=4,
        chunk_size=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )


MODELS: dict[str, tuple[str, Callable]] = {
    "qwen3_5": ("Qwen3_5ForCausalLM", qwen3_5_config),
    "nemotron_h": ("NemotronHForCausalLM", nemotron_h_config),
}


def token_stream(tokenizer, paths: list[Path]) -> torch.Tensor:
    """The files' tokens, each file after an EOS (documents separated as in pretraining)."""
    ids: list[int] = []
    for path in paths:
        ids += [EOS] + tokenizer.encode(path.read_text(encoding="utf-8")).ids
    return torch.tensor(ids, dtype=torch.long)


def batch_at(stream: torch.Tensor, gen: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq] for s in starts.tolist()])


def mean_loss(model, stream: torch.Tensor, seq: int) -> float:
    """Mean next-token loss over consecutive windows of ``seq`` tokens (as ``ppl`` scores them)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(stream) - 1, seq):
            window = stream[start : start + seq + 1][None]
            if window.shape[1] < 2:
                break
            logits = model(input_ids=window[:, :-1]).logits.float()
            total += float(torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum"))
            count += window.shape[1] - 1
    return total / count


def train(name: str, args: argparse.Namespace, tok_dir: Path) -> dict:
    """Build, train and save model ``name``; returns what ``training.json`` records."""
    import transformers as tf
    from tokenizers import Tokenizer

    arch, make_config = MODELS[name]
    tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    stream = token_stream(tokenizer, [CALIBRATION / f for f in TRAIN_FILES])
    held_out = token_stream(tokenizer, [EVAL_TEXT])
    torch.manual_seed(args.seed)
    model = getattr(tf, arch)(make_config()).float().train()
    params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {arch}, {params / 1e6:.2f} M parameters, {len(stream)} training tokens", flush=True)

    # No weight decay on norms, biases and the SSM's per-head A/D/dt (as in most pretraining).
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to a tenth
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(args.seed)
    curve: list[tuple[int, float]] = []
    window: list[float] = []
    report_every = max(1, args.steps // 10)
    t0 = time.perf_counter()
    for step in range(args.steps):
        ids = batch_at(stream, gen, args.batch, args.seq)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        window.append(loss.item())
        if (step + 1) % report_every == 0 or step + 1 == args.steps:
            avg = sum(window) / len(window)
            curve.append((step + 1, round(avg, 4)))
            print(f"  step {step + 1:5d}  loss {avg:.3f}  [{time.perf_counter() - t0:.0f} s]", flush=True)
            window = []
    seconds = time.perf_counter() - t0

    # Scored as saved: weights rounded to fp16 (computed in fp32).
    model = model.half().float().eval()
    held_out_loss = mean_loss(model, held_out, args.seq)
    print(f"  held-out loss {held_out_loss:.3f} (ppl {math.exp(held_out_loss):.1f}) on {EVAL_TEXT.name}")
    out = args.out / name
    if out.exists():
        shutil.rmtree(out)
    model.half().save_pretrained(out, safe_serialization=True)
    for f in TOKENIZER_FILES:
        shutil.copyfile(tok_dir / f, out / f)  # not the fixture's read-only mode
    info = {
        "architecture": arch,
        "parameters": params,
        "seed": args.seed,
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "lr": args.lr,
        "train_files": [f"engine/convert/calibration/{f}" for f in TRAIN_FILES],
        "train_tokens": len(stream),
        "loss_curve": curve,
        "held_out_text": "tests/data/public_domain.txt",
        "held_out_ppl": round(math.exp(held_out_loss), 2),
        "train_seconds": round(seconds, 1),
        "torch": torch.__version__,
        "transformers": tf.__version__,
    }
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"  wrote {out} ({size / 1e6:.2f} MB) after {seconds:.0f} s of training", flush=True)
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=sorted(MODELS), help="train one model (default: both)")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    # One thread is ~1.5x slower on an idle two-core machine but far faster on a busy one, where
    # two processes' OpenMP threads spinning on the same cores slow each other ~20x.
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tok_dir = tokenizer_dir()
    for name in [args.only] if args.only else list(MODELS):
        train(name, args, tok_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

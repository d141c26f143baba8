"""Scale tuning on the GPU (engine.convert.finetune): the fused kernels have no backward, so ops that
need gradients take the torch path, and the gradients equal the CPU's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine.kernels import fused
from engine.modules.norms import RMSNorm, add_and_norm

pytestmark = pytest.mark.cuda


def test_kernels_decline_tensors_that_need_gradients(cuda_extension) -> None:
    norm = RMSNorm(torch.rand(64, device="cuda") + 0.5, 1e-6)
    h = torch.randn(8, 64, device="cuda")
    assert fused.rms_norm(h, norm.weight, 1e-6, 0.0) is not None  # the kernel, without gradients
    delta = torch.randn(8, 64, device="cuda", requires_grad=True)
    assert fused.add_rms_norm(h, delta, norm.weight, 1e-6, 0.0) is None
    _, x = add_and_norm(h, delta, norm)
    x.square().sum().backward()
    cpu_delta = delta.detach().cpu().requires_grad_()
    cpu_norm = RMSNorm(norm.weight.detach().cpu(), 1e-6)
    _, x_cpu = add_and_norm(h.cpu(), cpu_delta, cpu_norm)
    x_cpu.square().sum().backward()
    torch.testing.assert_close(delta.grad.cpu(), cpu_delta.grad, rtol=1e-4, atol=1e-5)


TUNING_LINE = re.compile(r"scale tuning: held-out error (\S+) -> (\S+) \((kept|not kept),")


@pytest.mark.slow
def test_conversion_with_scale_tuning_on_the_gpu(exl3_dir: Path, tmp_path: Path) -> None:
    """Each block's tuning is kept exactly when it lowers the held-out error. Until the first kept
    block the conversion is the untuned one (a dropped tuning restores the scales); from there on it
    differs, since later blocks see the tuned block's output. The tuning may decline a block (on
    this model it declined the first one, 2026-12-01), so not every block must change."""
    from engine.convert.options import ConvertOptions
    from engine.convert.pipeline import convert_model

    src = exl3_dir / "tiny-llama-hf"
    rfn, verdicts = {}, {}
    for target in ("block", "model"):
        for steps in (0, 60):
            options = ConvertOptions(
                bits=4.0,
                head_bits=16,
                cal_rows=16,
                cal_cols=128,
                device="cuda",
                tune_steps=steps,
                tune_target=target,
                tf32=False,  # measured in fp32 on the GPU (tenth session), before TF32 was the default
            )
            lines: list[str] = []
            report = convert_model(src, tmp_path / f"{target}{steps}", options, log=lines.append)
            rfn[target, steps] = [b["rfn"] for b in report.blocks]
            found = [TUNING_LINE.search(line) for line in lines]
            verdicts[target, steps] = [(float(m[1]), float(m[2]), m[3] == "kept") for m in found if m]
    for target in ("block", "model"):
        assert verdicts[target, 0] == []
        assert len(verdicts[target, 60]) == len(rfn[target, 60])
        kept_so_far = False
        for (before, after, kept), tuned, untuned in zip(
            verdicts[target, 60], rfn[target, 60], rfn[target, 0], strict=True
        ):
            assert kept == (after < before)
            kept_so_far |= kept
            assert (tuned != untuned) == kept_so_far, (target, rfn, verdicts)
    assert rfn["block", 0] == rfn["model", 0]  # the untuned conversion does not depend on the target
    first_kept = next((i for i, v in enumerate(verdicts["block", 60]) if v[2]), None)
    assert first_kept is not None, verdicts
    assert rfn["block", 60][first_kept] < rfn["block", 0][first_kept], rfn

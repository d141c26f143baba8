"""Scale tuning on the GPU (engine.quant.finetune): the fused kernels have no backward, so ops that
need gradients take the torch path, and the gradients equal the CPU's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import ops
from engine.modules.norms import RMSNorm, add_and_norm

pytestmark = pytest.mark.cuda


def test_kernels_decline_tensors_that_need_gradients(cuda_extension) -> None:
    norm = RMSNorm(torch.rand(64, device="cuda") + 0.5, 1e-6)
    h = torch.randn(8, 64, device="cuda")
    assert ops.rms_norm(h, norm.weight, 1e-6, 0.0) is not None  # the kernel, without gradients
    delta = torch.randn(8, 64, device="cuda", requires_grad=True)
    assert ops.add_rms_norm(h, delta, norm.weight, 1e-6, 0.0) is None
    _, x = add_and_norm(h, delta, norm)
    x.square().sum().backward()
    cpu_delta = delta.detach().cpu().requires_grad_()
    cpu_norm = RMSNorm(norm.weight.detach().cpu(), 1e-6)
    _, x_cpu = add_and_norm(h.cpu(), cpu_delta, cpu_norm)
    x_cpu.square().sum().backward()
    torch.testing.assert_close(delta.grad.cpu(), cpu_delta.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_conversion_with_scale_tuning_on_the_gpu(exl3_dir: Path, tmp_path: Path) -> None:
    from engine.quant.convert import ConvertOptions, convert_model

    src = exl3_dir / "tiny-llama-hf"
    rfn = {}
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
            report = convert_model(src, tmp_path / f"{target}{steps}", options, log=lambda m: None)
            rfn[target, steps] = [b["rfn"] for b in report.blocks]
    assert all(t < p for t, p in zip(rfn["block", 60], rfn["block", 0])), rfn
    assert rfn["model", 60] != rfn["model", 0], rfn

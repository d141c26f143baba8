"""The converter on the GPU with its calibration states in host memory (``--states host``): each
chunk of rows goes to the device to run and comes back, so the result is the one the states on
the device give, bit for bit; and the source blocks are read one at a time there too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.cuda


@pytest.mark.slow
@pytest.mark.parametrize("tune_target", ["none", "model"])
def test_states_on_the_host_convert_as_on_the_device(
    exl3_dir: Path, tmp_path: Path, tune_target: str
) -> None:
    from engine.convert.options import ConvertOptions
    from engine.convert.pipeline import convert_model

    out, rfn = {}, {}
    for place in ("device", "host"):
        options = ConvertOptions(
            bits=4.0,
            head_bits=16,  # a 16-bit head: every stored tensor comes from the blocks' path
            cal_rows=16,
            cal_cols=128,
            device="cuda",
            states=place,
            tune_steps=20 if tune_target == "model" else 0,
            tune_target="model" if tune_target == "model" else "block",
        )
        lines: list[str] = []
        report = convert_model(exl3_dir / "tiny-llama-hf", tmp_path / place, options, log=lines.append)
        assert any("calibration states" in line and ("host" in line) == (place == "host") for line in lines)
        assert not any("page-lock" in line for line in lines)  # the host states were pinned
        out[place] = load_file(str(tmp_path / place / "model.safetensors"))
        rfn[place] = [b["rfn"] for b in report.blocks]
    # The per-block error is summed a chunk at a time on the device either way: the same number.
    assert rfn["device"] == rfn["host"]
    assert out["device"].keys() == out["host"].keys()
    for key, tensor in out["device"].items():
        assert torch.equal(tensor, out["host"][key]), key


def test_a_six_bit_head_from_host_states_matches_closely(exl3_dir: Path, tmp_path: Path) -> None:
    """With the states on the host the head's Hessian is summed a chunk at a time: the same sum,
    rounded differently, so the head is near (not bit-) identical."""
    from engine.convert.block_quantizer import linear_tensors
    from engine.convert.options import ConvertOptions
    from engine.convert.pipeline import convert_model
    from engine.exl3 import EXL3Linear

    heads = {}
    for place in ("device", "host"):
        options = ConvertOptions(bits=4.0, head_bits=6, cal_rows=8, cal_cols=64, device="cuda", states=place)
        convert_model(exl3_dir / "tiny-llama-hf", tmp_path / place, options, log=lambda m: None)
        tensors = load_file(str(tmp_path / place / "model.safetensors"))
        head = linear_tensors(tensors, "lm_head")
        rows, cols = head["lm_head.trellis"].shape[:2]  # 16x16 tiles: in x out
        heads[place] = EXL3Linear.from_tensors(head, rows * 16, cols * 16, None).weight
    rel = float((heads["host"] - heads["device"]).norm() / heads["device"].norm())
    assert rel < 0.05, rel  # 6-bit noise is ~0.017 (MSE per K): two independent ones differ by ~0.025


def test_host_pins_register_and_unregister_on_cuda() -> None:
    """cudaHostRegister through torch.cuda.cudart() pins a tensor's own pages: copies from it are
    asynchronous-capable, and unregistering leaves it an ordinary tensor."""
    from engine.convert.host_states import HostPins

    notes: list[str] = []
    t = torch.arange(1 << 20, dtype=torch.float32)
    with HostPins(torch.device("cuda"), notes.append) as pins:
        assert pins.pin(t), notes
        assert t.is_pinned()
        assert torch.equal(t.to("cuda", non_blocking=True).cpu(), t)
    assert not t.is_pinned()
    assert notes == []

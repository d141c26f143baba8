"""Loading a model across several GPUs from the app: the load options offer a tensor-parallel
split and a layer split where the GPU check saw more than one GPU, the choice reaches the worker,
and a rank that dies shows an error while the app can load the model again."""

from __future__ import annotations

import os
import signal

import pytest
from gui_helpers import load_model

from app.gpu_check import GpuDevice, GpuFacts, GpuReport
from app.library.parallel_choice import ParallelChoice
from app.worker import EngineClient
from engine.api import GenerationRequest


def _gpus(count: int) -> GpuReport:
    devices = tuple(GpuDevice(f"NVIDIA H100 #{i}", 80 * 2**30, (9, 0)) for i in range(count))
    return GpuReport(True, "GPU found.", facts=GpuFacts(cuda_available=True, devices=devices))


def test_split_across_gpus_is_offered_with_several_gpus(qtbot, make_window, fake_engine) -> None:
    window = make_window()
    options = window.library_pane.load_options
    window.show_gpu_report(_gpus(1))
    assert not options.split_gpus.isVisibleTo(options) and not options.layer_split.isVisibleTo(options)
    assert options.parallel_choice().is_single

    window.show_gpu_report(_gpus(2))
    assert options.split_gpus.isVisibleTo(options) and options.layer_split.isVisibleTo(options)
    assert options.split_gpus.maximum() == 2
    options.split_gpus.setValue(2)
    load_model(qtbot, window)
    assert fake_engine.load_options[-1]["parallel"] == ParallelChoice(gpus=2)

    options.split_gpus.setValue(1)
    options.layer_split.setText(" 1,1 ")
    load_model(qtbot, window, "other-model")
    assert fake_engine.load_options[-1]["parallel"] == ParallelChoice(gpus=1, split_layers="1,1")

    window.show_gpu_report(_gpus(1))  # one GPU again: a plain load, the fields hidden and cleared
    assert not options.split_gpus.isVisibleTo(options) and options.parallel_choice().is_single
    load_model(qtbot, window, "third-model")
    assert "parallel" not in fake_engine.load_options[-1]


@pytest.mark.slow
def test_a_dead_rank_shows_an_error_and_the_model_loads_again(qtbot, tiny_llama_hf) -> None:
    """The real path on the CPU: two gloo processes, rank 1 killed between replies."""
    client = EngineClient()
    try:
        with qtbot.waitSignal(client.loaded, timeout=120_000):
            client.load(tiny_llama_hf, "cpu", parallel=ParallelChoice(gpus=2))
        session = client.worker._session
        assert session.run is not None and len(session.run.pids) == 1
        os.kill(session.run.pids[0], signal.SIGKILL)
        errors: list[str] = []
        client.error.connect(errors.append)
        with qtbot.waitSignal(client.generationFinished, timeout=60_000) as finished:
            client.generate(
                [{"role": "user", "content": "Hello"}], GenerationRequest(max_new_tokens=8, completion=True)
            )
        assert finished.args[1].stop_reason == "error"
        assert any("tensor-parallel rank 1" in e for e in errors), errors
        with qtbot.waitSignal(client.loaded, timeout=120_000):
            client.load(tiny_llama_hf, "cpu", parallel=ParallelChoice(gpus=2))
        with qtbot.waitSignal(client.generationFinished, timeout=60_000) as finished:
            client.generate(
                [{"role": "user", "content": "Hello"}], GenerationRequest(max_new_tokens=4, completion=True)
            )
        assert finished.args[1].stop_reason != "error"
    finally:
        client.shutdown()

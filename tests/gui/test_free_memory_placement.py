"""The automatic choice of where a model runs compares with the GPUs' free memory where the GPU
check read it, and with more than one GPU the load options offer "Split across GPUs
automatically", chosen on its own where the model fits the GPUs together, and loaded as the
engine's automatic layer split."""

from __future__ import annotations

from pathlib import Path

from sparse_models import GIB, big_dense

from app.gpu_check import GpuDevice, GpuFacts, GpuReport
from app.library.parallel_choice import ParallelChoice


def _gpus(*free: int, size: int = 80 * GIB) -> GpuReport:
    devices = tuple(GpuDevice(f"NVIDIA H100 #{i}", size, (9, 0), f) for i, f in enumerate(free))
    return GpuReport(True, "GPU found.", facts=GpuFacts(cuda_available=True, devices=devices))


def _select(window, path: Path) -> None:
    window.library.refresh()
    window.library_pane.select_path(str(path))


def test_free_memory_decides_where_the_model_runs(qtbot, make_window, fake_engine) -> None:
    window = make_window()
    options = window.library_pane.load_options
    dense = big_dense(window.models_dir)
    # An 80 GiB card holds the 4.5 GiB model, but only 3 GiB of it is free: the first layers go there.
    window.show_gpu_report(_gpus(3 * GIB))
    assert options.gpu_memory == (3 * GIB,) and options.gpu_memory_free
    _select(window, dense)
    assert options.placement.currentData() == "layers" and options.gpu_layers.value() == 2
    assert "has 3.0 GiB free" in options.placement_reason.text()
    assert options.placement.findData("split") < 0  # one GPU: no split across GPUs offered

    # Where the check could not read free memory, the card's size stands in (chosen anew).
    window.show_gpu_report(_gpus(0))
    assert options.gpu_memory == (80 * GIB,) and not options.gpu_memory_free
    assert options.placement.currentData() == "gpu"


def test_two_gpus_that_hold_the_model_together_split_it(qtbot, make_window, fake_engine) -> None:
    window = make_window()
    options = window.library_pane.load_options
    dense = big_dense(window.models_dir)
    window.show_gpu_report(_gpus(4 * GIB, 4 * GIB))
    split = options.placement.findData("split")
    assert options.placement.itemText(split) == "Split across GPUs automatically"
    _select(window, dense)
    assert options.placement.currentData() == "split"
    assert "has 4.0 GiB free: its layers are split across the 2 GPUs" in options.placement_reason.text()
    assert "system memory" not in options.estimate.text()
    with qtbot.waitSignal(window.engine.loaded, timeout=5000):
        window.request_load(str(dense))
    assert fake_engine.load_options[-1]["parallel"] == ParallelChoice(split_layers="auto")

    # Too little free on the second card: the first layers on the GPU, the rest on the CPU.
    window.show_gpu_report(_gpus(4 * GIB, GIB))
    assert options.placement.currentData() == "layers"

    # The user may still pick the split; with one GPU again it is no longer offered.
    options.placement.setCurrentIndex(options.placement.findData("split"))
    options.placement.activated.emit(options.placement.currentIndex())
    assert options.parallel_choice() == ParallelChoice(split_layers="auto")
    window.show_gpu_report(_gpus(4 * GIB))
    assert options.placement.findData("split") < 0 and options.placement.currentData() == "layers"
    options.set_gpu_count(2, 4 * GIB, (4 * GIB, 4 * GIB), free=True)
    options.set_placement("split")
    options.set_gpu_count(1, 4 * GIB, (4 * GIB,), free=True)  # the split falls back to all on the GPU
    assert options.placement.findData("split") < 0 and options.placement.currentData() == "gpu"

"""Where the model runs, from the app: with a GPU the load options offer all on the GPU, experts in
system memory and the first layers on the GPU; a model too big for the GPU gets the fitting choice
on its own with a line saying why, the estimate shows the GPU and system-memory parts, and the
choice reaches the worker."""

from __future__ import annotations

from pathlib import Path

from sparse_models import GIB, big_dense, big_moe

from app.gpu_check import GpuDevice, GpuFacts, GpuReport
from app.library.parallel_choice import ParallelChoice


def _gpu(memory: int) -> GpuReport:
    device = GpuDevice("NVIDIA L4", memory, (8, 9))
    return GpuReport(True, "GPU found.", facts=GpuFacts(cuda_available=True, devices=(device,)))


def _select_and_load(qtbot, window, path: Path) -> None:
    window.library.refresh()
    window.library_pane.select_path(str(path))
    with qtbot.waitSignal(window.engine.loaded, timeout=5000):
        window.request_load(str(path))


def test_a_model_too_big_for_the_gpu_is_placed_to_fit(qtbot, make_window, fake_engine) -> None:
    window = make_window()
    options = window.library_pane.load_options
    assert not options.placement.isVisibleTo(options)  # no GPU reported yet
    window.show_gpu_report(_gpu(2 * GIB))
    assert options.placement.isVisibleTo(options) and not options.split_gpus.isVisibleTo(options)

    moe = big_moe(window.models_dir)
    _select_and_load(qtbot, window, moe)
    assert options.placement.currentData() == "experts"
    assert "experts stay in system memory" in options.placement_reason.text()
    assert "has 2.0 GiB" in options.placement_reason.text()
    assert "GPU ≈" in options.estimate.text() and "system memory ≈" in options.estimate.text()
    assert fake_engine.load_options[-1]["parallel"] == ParallelChoice(experts_on="cpu")

    dense = big_dense(window.models_dir)
    _select_and_load(qtbot, window, dense)
    assert options.placement.currentData() == "layers" and options.gpu_layers.value() == 1
    assert options.gpu_layers.isVisibleTo(options) and options.gpu_layers.maximum() == 4
    assert "its first 1 of 4 layers fit there" in options.placement_reason.text()
    assert fake_engine.load_options[-1]["parallel"] == ParallelChoice(gpu_layers=1)


def test_the_users_choice_is_kept_and_a_model_that_fits_runs_on_the_gpu(
    qtbot, make_window, fake_engine
) -> None:
    window = make_window()
    options = window.library_pane.load_options
    window.show_gpu_report(_gpu(80 * GIB))
    dense = big_dense(window.models_dir)
    window.library.refresh()
    window.library_pane.select_path(str(dense))
    assert options.placement.currentData() == "gpu" and options.placement_reason.text() == ""
    assert "system memory" not in options.estimate.text()

    # The user asks for 3 layers on the GPU: the choice and its estimate follow, and stay.
    options.placement.setCurrentIndex(options.placement.findData("layers"))
    options.placement.activated.emit(options.placement.currentIndex())
    options.gpu_layers.setValue(3)
    assert "system memory ≈" in options.estimate.text()
    window.library.refresh_estimates()  # the estimates refresh: the user's choice is not undone
    assert options.current_placement() == ("layers", 3)
    with qtbot.waitSignal(window.engine.loaded, timeout=5000):
        window.request_load(str(dense))
    assert fake_engine.load_options[-1]["parallel"] == ParallelChoice(gpu_layers=3)

    window.show_gpu_report(GpuReport(False, "No GPU."))  # no GPU: no choice, a plain load
    assert not options.placement.isVisibleTo(options) and options.parallel_choice().is_single

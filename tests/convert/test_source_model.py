"""The converter's view of the source model (engine.convert.source_model): its blocks are read from
the checkpoint one at a time, so converting needs one block's weights on the device, not the
whole model's."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from quant_helpers import cheap_encoder

import engine.convert.quantize as quantize_mod
from engine.loading.builder import ModelBuilder
from engine.loading.safetensors_store import WeightStore


def _record_reads(monkeypatch) -> list[str]:
    keys: list[str] = []
    real = WeightStore.get

    def get(self, key, *args, **kwargs):
        keys.append(key)
        return real(self, key, *args, **kwargs)

    monkeypatch.setattr(WeightStore, "get", get)
    return keys


def test_the_slots_are_known_before_any_block_is_read(exl3_dir: Path, monkeypatch) -> None:
    from engine.convert.source_model import SourceModel

    reads = _record_reads(monkeypatch)
    source = SourceModel(exl3_dir / "tiny-llama-hf", torch.device("cpu"))
    assert sorted(reads) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert len(source.slots) == len(source.blocks) == source.spec.num_layers == 2
    store = WeightStore(exl3_dir / "tiny-llama-hf")
    for i, slots in enumerate(source.slots):
        assert [s.kind for s in slots] == ["q", "k", "v", "o", "gate", "up", "down"]
        for s in slots:
            assert s.key.startswith(f"model.layers.{i}.")
            assert store.shape(s.key + ".weight") == [s.out_features, s.in_features]


def test_blocks_are_read_one_at_a_time_and_equal_the_loaded_model(exl3_dir: Path, monkeypatch) -> None:
    from engine.convert.source_model import SourceModel
    from engine.model import load_model

    src = exl3_dir / "tiny-llama-hf"
    whole = load_model(src, device="cpu", dtype=torch.float32).module
    reads = _record_reads(monkeypatch)
    source = SourceModel(src, torch.device("cpu"))
    held: list[list[torch.Tensor]] = []
    for i in range(len(source.blocks)):
        del reads[:]
        block = source.blocks[i]
        assert source.blocks[i] is block  # asked again: the same block, not read again
        assert reads and all(k.startswith(f"model.layers.{i}.") for k in reads)
        for (name, p), (_, q) in zip(
            block.state_dict().items(), whole.blocks[i].state_dict().items(), strict=True
        ):
            assert torch.equal(p, q), name
        for s in source.slots[i]:
            assert s.get() is not None and s.get().weight.device.type == "cpu"  # pointed at the block
        held.append(list(block.parameters()))
        # Only the latest block's weights are in memory, though this test holds every one.
        assert [all(w.untyped_storage().nbytes() == 0 for w in ws) for ws in held] == [True] * i + [False]
    source.blocks.release()
    assert all(w.untyped_storage().nbytes() == 0 for ws in held for w in ws)
    assert all(rope.inv_freq.untyped_storage().nbytes() for rope in source.rope.values())  # shared: kept
    with pytest.raises(IndexError):
        source.blocks[2]


@pytest.mark.slow
def test_a_conversion_holds_one_source_block_at_a_time(exl3_dir: Path, tmp_path: Path, monkeypatch) -> None:
    import engine.model
    from engine.convert.options import ConvertOptions
    from engine.convert.pipeline import convert_model

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)

    def whole_model(*args, **kwargs):
        raise AssertionError("the converter loaded the whole model")

    monkeypatch.setattr(engine.model, "load_model", whole_model)
    # Each built block's weights, weakly: the quantization pass swaps a block's dense linears out
    # (then nothing should hold them), and a caller may still hold a weight of the block (then
    # its memory must have been freed all the same).
    built: list[tuple[int, list[weakref.ref]]] = []
    real_block = ModelBuilder.block

    def in_memory(ref: weakref.ref) -> bool:
        w = ref()
        return w is not None and w.untyped_storage().nbytes() > 0

    def block(self, i, rope):
        if self.device.type == "meta":
            return real_block(self, i, rope)
        gc.collect()
        held = [j for j, refs in built if any(map(in_memory, refs))]
        assert not held, f"reading block {i} while the weights of block(s) {held} are still in memory"
        made = real_block(self, i, rope)
        built.append((i, [weakref.ref(p) for p in made.parameters()]))
        return made

    monkeypatch.setattr(ModelBuilder, "block", block)
    options = ConvertOptions(bits=4.0, head_bits=6, cal_rows=4, cal_cols=32, device="cpu")
    report = convert_model(exl3_dir / "tiny-llama-hf", tmp_path / "out", options, log=lambda m: None)
    # The sensitivity pre-pass reads the blocks once, the quantization pass once more.
    assert [i for i, _ in built] == [0, 1, 0, 1]
    assert len(report.blocks) == 2 and report.bits == 4.0


@pytest.mark.parametrize(
    ("change", "message"),
    [("drop", "'model.layers.1.mlp.down_proj.weight' is missing"), ("reshape", "has shape")],
)
def test_a_bad_tensor_in_the_last_block_is_named_before_any_block_is_read(
    exl3_dir: Path, tmp_path: Path, monkeypatch, change: str, message: str
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.convert.source_model import SourceModel
    from engine.errors import ModelLoadError

    src = exl3_dir / "tiny-llama-hf"
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    key = "model.layers.1.mlp.down_proj.weight"
    if change == "drop":
        del tensors[key]
    else:
        tensors[key] = tensors[key][:, :-16].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reads = _record_reads(monkeypatch)
    with pytest.raises(ModelLoadError, match=message):
        SourceModel(tmp_path, torch.device("cpu"))
    assert not any(k.startswith("model.layers.") and k != key for k in reads)


def _slots(sizes: list[tuple[int, int]]):
    from engine.convert.slots import LinearSlot

    return [[LinearSlot(f"l{i}", "q", None, "0", a, b) for i, (a, b) in enumerate(sizes)]]


@pytest.mark.parametrize(
    ("place", "free_gb", "expected"),
    [
        ("auto", 80.0, "cuda"),  # 2 x 250 x 2048 x 4096 floats = 16.8 GB + 0.3 GB block: fits in 60%
        ("auto", 24.0, "cpu"),  # a 24 GB GPU: 17.1 GB is more than 60% of it
        ("device", 24.0, "cuda"),
        ("host", 80.0, "cpu"),
    ],
)
def test_where_the_calibration_states_go(monkeypatch, place: str, free_gb: float, expected: str) -> None:
    from engine.convert.host_states import state_device

    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (int(free_gb * 1e9), int(free_gb * 1e9))
    )
    lines: list[str] = []
    block = _slots([(4096, 4096), (4096, 14336)])  # 75M weights: 0.3 GB in float32
    got = state_device(place, torch.device("cuda"), (250, 2048), 4096, 2, block, lines.append)
    assert got.type == expected
    assert "16.8 GB" in lines[0] and ("host memory" in lines[0]) == (expected == "cpu")
    # A CPU conversion keeps them where it runs, whatever is asked.
    assert state_device(place, torch.device("cpu"), (250, 2048), 4096, 2, block, print).type == "cpu"


def test_an_unknown_place_for_the_states_is_named_before_any_work() -> None:
    from engine.convert.errors import ConvertError
    from engine.convert.options import ConvertOptions

    with pytest.raises(ConvertError, match="states: .*'disk'.*auto, device, host"):
        ConvertOptions(bits=4.0, device="cpu", states="disk")


def test_the_calibration_rows_are_embedded_once_on_the_host(exl3_dir: Path) -> None:
    from engine.convert.source_model import SourceModel
    from engine.model import load_model

    src = exl3_dir / "tiny-llama-hf"
    source = SourceModel(src, torch.device("cpu"))
    assert source.shell.embedding.weight.device.type == "cpu"
    ids = torch.randint(0, source.spec.vocab_size, (3, 16))
    hidden = source.embed_rows(ids, torch.device("cpu"))
    whole = load_model(src, device="cpu", dtype=torch.float32).module
    assert hidden.shape == (3, 16, source.spec.hidden_size) and hidden.dtype == torch.float32
    assert torch.equal(hidden, whole.embed(ids))
    assert source.shell.embedding is None  # the table is let go of once the rows are embedded


@pytest.mark.parametrize(("argv", "expected"), [([], "auto"), (["--states", "host"], "host")])
def test_convert_passes_states_to_the_converter(tmp_path: Path, monkeypatch, argv, expected) -> None:
    import engine.convert.pipeline as pipeline
    from engine.cli import main as cli_main

    seen = {}

    def record(src, out, options, resume=False, log=print, progress=None):
        seen["options"] = options
        return pipeline.ConvertReport(bits=4.0)

    monkeypatch.setattr(pipeline, "convert_model", record)
    assert cli_main(["convert", "-i", str(tmp_path), "-o", str(tmp_path / "out"), "-b", "4", *argv]) == 0
    assert seen["options"].states == expected
    assert "states" not in seen["options"].job_key()  # a resume may change where they live


def test_projections_the_engine_fuses_are_listed_as_stored():
    # Qwen3.5's 16-bit b and a run as one matrix; the output must still hold them apart, as the
    # checkpoint does, or the converted model would not load.
    from engine.convert.source_model import SourceModel

    directory = Path(__file__).parents[1] / "data" / "tiny-hybrids" / "qwen3_5"
    source = SourceModel(directory, torch.device("cpu"))
    linear_attention = [keys for keys in source.layouts if any("linear_attn" in k for k in keys)]
    assert linear_attention
    for keys in linear_attention:
        prefix = next(k for k in keys if "linear_attn" in k).split("linear_attn")[0]
        assert {prefix + "linear_attn.in_proj_b", prefix + "linear_attn.in_proj_a"} <= set(keys)

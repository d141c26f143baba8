"""What one conversion is asked to do: :class:`ConvertOptions`, checked once, when they are made.

Every option that changes the result is part of :meth:`ConvertOptions.job_key`, which a resumed
job must match (:mod:`engine.convert.checkpoints`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.convert.errors import ConvertError
from engine.exl3.codebooks import CODEBOOKS, MUL1

# How bits are spread over the linears (engine.convert.bit_plan): "sensitivity" measures each
# linear's cost and spends the budget where it helps most; "uniform" gives every linear the same K
# (extra fractional bits by projection kind).
ALLOCATIONS = ("sensitivity", "uniform")
# What scale tuning aims at (engine.convert.block_quantizer.tune_block).
TUNE_TARGETS = ("block", "model")
# Where the calibration hidden states live (engine.convert.host_states.state_device).
STATE_PLACES = ("auto", "device", "host")


@dataclass
class ConvertOptions:
    bits: float
    head_bits: int = 6
    codebook: str = MUL1
    cal_rows: int = 250
    cal_cols: int = 2048
    random_rows_fraction: float = 0.1
    out_scales: bool = True
    seed: int = 0
    shard_size_mb: int = 8192
    device: str = "auto"
    # "sensitivity": measured per-linear bits; "uniform": the kind priority (ALLOCATIONS).
    allocation: str = "sensitivity"
    sensitivity_rows: int = 32  # calibration rows the sensitivity pre-pass runs over
    tf32: bool = True  # calibration matmuls on TF32 tensor cores (CUDA; see calibration_matmuls)
    damping: float = 0.01  # Hessian damping relative to its mean diagonal (engine.convert.ldl)
    refit: bool = True  # refit suh/svh to the chosen trellis (engine.convert.refit)
    tune_steps: int = 0  # Adam steps tuning each block's scales to its output (engine.convert.finetune)
    # What the tuning aims at: "block", the unquantized block on the quantized model's inputs;
    # "model", the unquantized model's own hidden state there (also undoes earlier blocks' error,
    # at one more block forward and one more hidden-state buffer).
    tune_target: str = "block"
    tune_lr: float = 1e-3  # Adam's learning rate on the scale multipliers' offsets
    # Capture each input group's Hessian after the groups before it in the block are quantized
    # (o_proj sees the quantized q/k/v, down the quantized gate/up): see hessians.input_groups.
    sequential: bool = False
    # Calibration text: a file, or a folder whose files are read in name order ("" = the text
    # shipped in engine/convert/calibration).
    cal_text: str = ""
    # Share of the text rows the model writes itself, continuing snippets of the calibration
    # text (engine.convert.self_calibration); the rest are the text itself.
    generated_rows: float = 0.0
    # Where the calibration hidden states live: "device", "host" (CPU memory; each chunk of rows
    # goes to the device to run), or "auto": the device where they fit (see state_device).
    states: str = "auto"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConvertError` for the first option out of range, naming it. The device
        is checked where it is resolved (``engine.model.resolve_device``)."""

        def refuse(option: str, problem: str) -> None:
            raise ConvertError(f"converter option {option}: {problem}")

        def one_of(option: str, what: str, value: str, choices: tuple[str, ...]) -> None:
            if value not in choices:
                refuse(option, f"unknown {what} {value!r}; choose one of {', '.join(choices)}")

        if not 1.0 <= self.bits <= 8.0:
            refuse("bits", f"target bits per weight must be within 1.0..8.0, got {self.bits}")
        if not (1 <= self.head_bits <= 8 or self.head_bits == 16):
            refuse("head_bits", f"head bits must be 1..8 or 16, got {self.head_bits}")
        one_of("codebook", "codebook", self.codebook, CODEBOOKS)
        one_of("allocation", "allocation", self.allocation, ALLOCATIONS)
        one_of("tune_target", "tuning target", self.tune_target, TUNE_TARGETS)
        one_of("states", "place for the states", self.states, STATE_PLACES)
        for option in ("cal_rows", "cal_cols", "sensitivity_rows", "shard_size_mb"):
            if getattr(self, option) < 1:
                refuse(option, f"must be at least 1, got {getattr(self, option)}")
        if self.tune_steps < 0:
            refuse("tune_steps", f"must not be negative, got {self.tune_steps}")
        if not self.tune_lr > 0.0:
            refuse("tune_lr", f"the learning rate must be above 0, got {self.tune_lr}")
        if not self.damping >= 0.0:
            refuse("damping", f"the Hessian damping must not be negative, got {self.damping}")
        if not 0.0 <= self.random_rows_fraction <= 1.0:
            refuse(
                "random_rows_fraction",
                f"the share of random-token rows must be within 0..1, got {self.random_rows_fraction}",
            )
        if not 0.0 <= self.generated_rows <= 1.0:
            refuse(
                "generated_rows",
                f"the share of generated rows must be within 0..1, got {self.generated_rows}",
            )

    def job_key(self) -> dict:
        """The options that change the result (a resume must match them). Device, shard size,
        TF32 and where the states live do not: blocks converted either way can be assembled into
        one model."""
        d = asdict(self)
        for key in ("device", "shard_size_mb", "tf32", "states"):
            d.pop(key)
        # Options added later are left out where they are off, so a job started before they
        # existed still resumes.
        for key, off in (("cal_text", ""), ("generated_rows", 0.0)):
            if d[key] == off:
                d.pop(key)
        return d


__all__ = ["ALLOCATIONS", "STATE_PLACES", "TUNE_TARGETS", "ConvertOptions"]

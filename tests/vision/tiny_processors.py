"""Tiny tokenizers and processors for the tiny vision-language models, assembled offline.

The tokenizer is byte-level BPE with no merges (ids 0..255 are the bytes) plus each family's
special tokens from id 256 on. The chat templates are the families' real templates (Gemma 3,
Qwen2.5-VL) or a faithful reduction of them to one user turn (Qwen3-VL, Mistral 3, GLM-4V), kept
as data in ``templates/``.
"""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"

SPECIALS: dict[str, list[str]] = {
    "gemma3": [
        "<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
        "<start_of_image>", "<end_of_image>", "<image_soft_token>",
    ],
    "qwen": [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
        "<|image_pad|>", "<|video_pad|>",
    ],
    "mistral3": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"],
    "glm4v": [
        "<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
        "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>",
        "<|video|>",
    ],
}  # fmt: skip

FAMILY = {
    "Gemma3ForConditionalGeneration": "gemma3",
    "Qwen2_5_VLForConditionalGeneration": "qwen",
    "Qwen3VLForConditionalGeneration": "qwen",
    "Mistral3ForConditionalGeneration": "mistral3",
    "Glm4vForConditionalGeneration": "glm4v",
    "Glm4vMoeForConditionalGeneration": "glm4v",
}

TEMPLATE_FILE = {
    "Gemma3ForConditionalGeneration": "gemma3.jinja",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl.jinja",
    "Qwen3VLForConditionalGeneration": "qwen3_vl.jinja",
    "Mistral3ForConditionalGeneration": "mistral3.jinja",
    "Glm4vForConditionalGeneration": "glm4v.jinja",
    "Glm4vMoeForConditionalGeneration": "glm4v.jinja",
}


def special_id(family: str, token: str) -> int:
    return 256 + SPECIALS[family].index(token)


def _byte_tokenizer(specials: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return tok


def _byte_of(ch: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's printable mapping)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    others = [b for b in range(256) if b not in printable]
    code = ord(ch)
    if code in printable:
        return code
    return others[code - 256]


TOKEN_ROLES = {
    "gemma3": dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"),
    "qwen": dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
    "mistral3": dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
    "glm4v": dict(eos_token="<|user|>", pad_token="<|endoftext|>"),
}

EXTRA_TOKENS = {
    "gemma3": dict(
        boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>"
    ),
    "qwen": dict(
        image_token="<|image_pad|>", video_token="<|video_pad|>",
        vision_bos_token="<|vision_start|>", vision_eos_token="<|vision_end|>",
    ),
    "mistral3": dict(image_token="[IMG]", image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]"),
    "glm4v": dict(image_token="<|image|>", video_token="<|video|>"),
}  # fmt: skip


def image_processor_settings(arch: str, config) -> dict:
    """preprocessor_config.json fields for the tiny model (sizes scaled down with the tower)."""
    v = config.vision_config
    if arch == "Gemma3ForConditionalGeneration":
        return dict(
            image_processor_type="Gemma3ImageProcessor",
            size={"height": v.image_size, "width": v.image_size},
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
            resample=2,
            rescale_factor=1 / 255,
        )
    if arch in ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"):
        unit = v.patch_size * v.spatial_merge_size
        mean_std = (
            dict(
                image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711]
            )
            if arch.startswith("Qwen2")
            else dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
        )
        return dict(
            image_processor_type="Qwen2VLImageProcessor",
            size={"shortest_edge": 4 * unit * unit, "longest_edge": 64 * unit * unit},
            patch_size=v.patch_size,
            merge_size=v.spatial_merge_size,
            temporal_patch_size=v.temporal_patch_size,
            resample=3,
            **mean_std,
        )
    if arch in ("Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration"):
        # The pixel bounds count a still image twice (its temporal patch's frames): with these,
        # a 30 x 45 image is scaled down only because of that.
        unit = v.patch_size * v.spatial_merge_size
        return dict(
            image_processor_type="Glm4vImageProcessor",
            size={"shortest_edge": 4 * unit * unit, "longest_edge": 40 * unit * unit},
            patch_size=v.patch_size,
            merge_size=v.spatial_merge_size,
            temporal_patch_size=v.temporal_patch_size,
            image_mean=[0.48145466, 0.4578275, 0.40821073],
            image_std=[0.26862954, 0.26130258, 0.27577711],
            resample=3,
        )
    if arch == "Mistral3ForConditionalGeneration":
        return dict(
            image_processor_type="PixtralImageProcessor",
            size={"longest_edge": v.image_size},
            patch_size=v.patch_size * config.spatial_merge_size,
            image_mean=[0.48145466, 0.4578275, 0.40821073],
            image_std=[0.26862954, 0.26130258, 0.27577711],
            resample=3,
        )
    raise KeyError(arch)


def write_processor_files(arch: str, config, directory: Path) -> None:
    """tokenizer.json, tokenizer_config.json, chat_template.jinja and preprocessor_config.json."""
    family = FAMILY[arch]
    tok = _byte_tokenizer(SPECIALS[family])
    tok.save(str(directory / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", **TOKEN_ROLES[family], **EXTRA_TOKENS[family]}
    if family == "mistral3":
        tok_config["add_bos_token"] = False
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    (directory / "chat_template.jinja").write_text((TEMPLATES / TEMPLATE_FILE[arch]).read_text())
    (directory / "preprocessor_config.json").write_text(
        json.dumps(image_processor_settings(arch, config), indent=1)
    )


def _pixtral_processor_class():
    """transformers' PixtralProcessor, importable where torchvision is absent.

    Its module imports torchvision's functional API at the top for the torchvision image
    processor, which we never use (the Pillow one is the reference); empty stand-in modules
    satisfy the import and are removed again at once so nothing else sees them.
    """
    import sys
    import types

    names = (
        "torchvision",
        "torchvision.transforms",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
    )
    stubs = {name: types.ModuleType(name) for name in names if name not in sys.modules}
    if "torchvision.transforms.v2" in stubs and "torchvision.transforms.v2.functional" in stubs:
        stubs["torchvision.transforms.v2"].functional = stubs["torchvision.transforms.v2.functional"]
    sys.modules.update(stubs)
    try:
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
    finally:
        for name in stubs:
            sys.modules.pop(name, None)
    return PixtralProcessor


def _skip_processor_class_checks() -> None:
    """Qwen's processors insist on a video processor class, whose registry needs torchvision;
    we pass no video processor, so the class check is skipped."""
    from transformers.processing_utils import ProcessorMixin

    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: None


def hf_processor(arch: str, config, directory: Path):
    """The transformers processor for the tiny model, with the Pillow ("slow") image processor."""
    import transformers as tf

    _skip_processor_class_checks()

    family = FAMILY[arch]
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"),
        **TOKEN_ROLES[family],
        extra_special_tokens=EXTRA_TOKENS[family],
    )
    settings = {
        k: v for k, v in image_processor_settings(arch, config).items() if k != "image_processor_type"
    }
    template = (directory / "chat_template.jinja").read_text()
    if arch == "Gemma3ForConditionalGeneration":
        ip = tf.Gemma3ImageProcessorPil(**settings)
        return tf.Gemma3Processor(
            ip, tokenizer, chat_template=template, image_seq_length=config.mm_tokens_per_image
        )
    if arch == "Qwen2_5_VLForConditionalGeneration":
        ip = tf.Qwen2VLImageProcessorPil(**settings)
        return tf.Qwen2_5_VLProcessor(ip, tokenizer, chat_template=template)
    if arch == "Qwen3VLForConditionalGeneration":
        ip = tf.Qwen2VLImageProcessorPil(**settings)
        return tf.Qwen3VLProcessor(ip, tokenizer, None, chat_template=template)
    if arch in ("Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration"):
        ip = tf.Glm4vImageProcessorPil(**settings)
        return tf.Glm4vProcessor(ip, tokenizer, None, chat_template=template)
    if arch == "Mistral3ForConditionalGeneration":
        ip = tf.PixtralImageProcessorPil(**settings)
        return _pixtral_processor_class()(
            ip, tokenizer, chat_template=template, patch_size=config.vision_config.patch_size,
            spatial_merge_size=config.spatial_merge_size,
        )  # fmt: skip
    raise KeyError(arch)

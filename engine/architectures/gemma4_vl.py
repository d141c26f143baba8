"""Gemma 4 with images (Gemma4ForConditionalGeneration): the Gemma 4 decoder, and its own vision
tower with 2D RoPE and a pooling projector (``engine.vision.gemma4``). The audio tower of the
small sizes is not loaded; a prompt with audio is refused (``engine.vision.prompt``)."""

from engine.architectures.gemma4 import Gemma4
from engine.architectures.vision_language import VisionLanguage


class Gemma4VL(VisionLanguage, Gemma4):
    hf_names = ("Gemma4ForConditionalGeneration",)
    vision = "engine.vision.gemma4:Gemma4Vision"

"""Gemma 3 with images (Gemma3ForConditionalGeneration): the Gemma 3 decoder, SigLIP tower and
pooled projector (``engine.vision.gemma3``)."""

from engine.architectures.gemma3 import Gemma3
from engine.architectures.vision_language import VisionLanguage


class Gemma3VL(VisionLanguage, Gemma3):
    hf_names = ("Gemma3ForConditionalGeneration",)
    vision = "engine.vision.gemma3:Gemma3Vision"

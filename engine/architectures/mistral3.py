"""Mistral 3 with images (Mistral3ForConditionalGeneration, e.g. Mistral Small 3.1): the
Mistral decoder, and the Pixtral tower with a patch-merging projector
(``engine.vision.mistral3``)."""

from engine.architectures.mistral import Mistral
from engine.architectures.vision_language import VisionLanguage


class Mistral3(VisionLanguage, Mistral):
    hf_names = ("Mistral3ForConditionalGeneration",)
    vision = "engine.vision.mistral3:Mistral3Vision"

"""IQuest-Coder (IQuestCoderForCausalLM): Llama's decoder, as transformers maps its ``iquestcoder``
model type onto LlamaForCausalLM. The looped variant (IQuestLoopCoderForCausalLM, which runs its
layers twice with a gated second pass) is another architecture and not read here."""

from engine.architectures.llama import Llama


class IQuestCoder(Llama):
    hf_names = ("IQuestCoderForCausalLM",)

"""Images in the chat: loading and preprocessing them, vision towers, and splicing their
embeddings into the language model's token sequence.

A :class:`engine.vision.base.VisionModel` belongs to one architecture family: it knows the
family's preprocessing (grid rules), what text stands in for an image in the prompt, and how to
turn pixels into rows of the language model's embedding space. :mod:`engine.vision.prompt`
puts a chat with images into token ids plus a :class:`engine.vision.media.PromptMedia`, which
the generator carries with the job and each forward step reads its slice of.
"""

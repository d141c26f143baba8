"""The module library every architecture is assembled from.

Each module computes one thing from the paper it comes from; architectures only choose and
configure them (see ``engine.architectures``, and ``engine.layers`` for how a layer kind is
built). All modules work on a *flat* batch: the tokens of every sequence in a step are
concatenated into one ``[tokens, hidden]`` tensor, and :class:`engine.modules.batch.BatchLayout`
says which rows belong to which sequence. Dense maths (linears, norms, MLPs) run over all rows at
once; only mixers (attention, recurrent kinds) look at sequence boundaries.
"""

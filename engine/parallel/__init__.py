"""Several processes over one model: tensor parallelism on ``torch.distributed`` and layer split.

One concept per module: :mod:`~engine.parallel.launch` starts the ranks, :mod:`~.sharding` cuts a
loaded model into a rank's shard (:mod:`~.heads`, :mod:`~.slicing`, :mod:`~.vocab`,
:mod:`~.reduced`), :mod:`~.leader` and :mod:`~.follower` run the step protocol of
:mod:`~.step_plan` (decode steps through CUDA graphs every rank captures alike:
:mod:`~.graph_steps`; the cost of an all-reduce in one: :mod:`~.allreduce_cost`), and
:mod:`~.placement` puts consecutive layers on different devices (how many by each GPU's free
memory: :mod:`~.auto_split`); :mod:`~.placement_choice` loads a model as a front end asks for it.
See docs/PARALLEL.md.
"""

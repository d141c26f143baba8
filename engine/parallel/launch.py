"""Starting a tensor-parallel run: one process per rank, rank 0 being the caller's own process.

:func:`start_tensor_parallel` picks a free port on 127.0.0.1, spawns ranks ``1 .. N-1``
(``torch.multiprocessing``'s spawn), joins them in one process group (gloo on the CPU, NCCL
between GPUs; nothing listens beyond the loopback interface) and loads this rank's shard (read
alone from the files: :mod:`engine.parallel.shard_loading`); each
other rank loads its own and enters :func:`engine.parallel.follower.follow`. The result is a
:class:`~engine.model.LoadedModel` whose module is rank 0's :class:`LeaderModule`, for the usual
Generator, and the :class:`TensorParallelRun` that owns the processes.

Each collective inside a step is bounded by the run's timeout; the other ranks' wait for rank
0's next step is not (it may be idle), see :mod:`engine.parallel.messages`.

A rank that dies ends the run: a watchdog thread on rank 0 polls the other ranks' processes, and
when one ends unexpectedly it stops the others and remembers which one it was, so that the
failed collective on rank 0 becomes a :class:`RankFailedError` naming it. A rank blocked in a
collective that cannot fail promptly is covered by the collective timeout, and, where the run
was started with ``exit_on_failure`` (the CLI), by ending rank 0's process after a short grace.
The other ranks watch rank 0 in turn and exit when it is gone.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.errors import EngineError, UsageError
from engine.layers import sequence_states
from engine.loading.builder import ModelBuilder
from engine.model import LoadedModel, load_model
from engine.options import EngineOptions
from engine.parallel import messages
from engine.parallel.follower import follow
from engine.parallel.leader import LeaderModule
from engine.parallel.shard_loading import ShardBuilder
from engine.parallel.sharding import ShardReport, local_states, shard_model
from engine.parallel.step_plan import Stop
from engine.parallel.stored_linear import load_stored

# How long rank 0 waits for its failed collective to surface before ending its process.
FAILURE_GRACE_S = 2.0
# How often the watchdogs look at the other processes.
POLL_S = 0.1
# The exit status of a rank whose collective failed because another rank went away: the watchdog
# names a rank that ended for a reason of its own first.
LOST_PEER_STATUS = 3


class RankFailedError(EngineError):
    """A rank of a tensor-parallel run ended (crash, out of memory, killed): the run is over."""

    def __init__(self, rank: int, how: str) -> None:
        super().__init__(f"tensor-parallel rank {rank} {how}; all ranks stopped")
        self.rank = rank


@dataclass(frozen=True)
class RankSetup:
    """What every rank needs to join the run and build its shard (pickled to the spawned ranks)."""

    directory: str
    world: int
    port: int
    device: str  # "cpu" or "cuda": rank r uses cuda:r
    dtype: str | None
    exl3_mode: str | None
    context: int | None
    options: EngineOptions | None
    timeout_s: float
    # Random weights of a shape instead of a directory: synthetic_model's arguments (shape,
    # bits, head bits, codebook, name, seed); every rank builds the same model and cuts it.
    synthetic: dict | None = None
    # A run of one rank that still makes its process group and shards (start_tensor_parallel's
    # group_of_one): the tensor-parallel path, collectives included, on one device.
    group_of_one: bool = False

    @property
    def sharded(self) -> bool:
        """Whether the ranks load shards (and join a process group)."""
        return self.world > 1 or self.group_of_one

    def rank_device(self, rank: int) -> torch.device:
        return torch.device("cuda", rank) if self.device == "cuda" else torch.device("cpu")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(setup: RankSetup, rank: int) -> None:
    """Join the run's process group as ``rank`` (loopback only)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    device = setup.rank_device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{setup.port}",
        rank=rank,
        world_size=setup.world,
        timeout=datetime.timedelta(seconds=setup.timeout_s),
    )
    messages.open_channel()


def load_shard(setup: RankSetup, rank: int) -> tuple[LoadedModel, ShardReport]:
    """This rank's model, reading only its shard of each split tensor from the files
    (:mod:`engine.parallel.shard_loading`): the whole model never has to fit one device."""
    if setup.synthetic is not None:
        model = _synthetic(setup, rank)
    else:
        builder = partial(ShardBuilder, rank=rank, world=setup.world) if setup.sharded else ModelBuilder
        model = load_model(
            setup.directory,
            device=str(setup.rank_device(rank)),
            dtype=setup.dtype,
            context=setup.context,
            exl3_mode=setup.exl3_mode,
            options=setup.options,
            make_builder=builder,
        )
    if rank > 0:  # rank 0's vision tower encodes the images; the steps carry its embeddings
        model = replace(model, vision=None)
    with torch.inference_mode():
        report = shard_model(model.module, rank, setup.world, grouped=setup.sharded)
        if load_stored(model.module):  # the linears kept whole on every rank
            _restack_whole_mixtures(model.module)
    return model, report


def _restack_whole_mixtures(module: torch.nn.Module) -> None:
    """Stack the experts of mixtures kept whole on every rank for the device-routed kernels, as
    the builder does: their linears were read only after the split."""
    from engine.modules.moe import SparseMoE
    from engine.modules.stacked_experts import stack_experts
    from engine.parallel.sharding import AbsentExpert

    for moe in module.modules():
        if isinstance(moe, SparseMoE) and not any(isinstance(e, AbsentExpert) for e in moe.experts):
            moe.stacked = stack_experts(moe.experts)


def _synthetic(setup: RankSetup, rank: int) -> LoadedModel:
    """The random-weight model ``setup.synthetic`` describes, whole on this rank's device: its
    weights come from one seeded stream in the builder's order, so every rank builds it whole
    (the same on each) before cutting its shard."""
    from engine.loading.synthetic_store import synthetic_model

    if setup.options is not None:
        setup.options.configure_kernels()
    dtype = getattr(torch, setup.dtype) if isinstance(setup.dtype, str) else setup.dtype
    return synthetic_model(
        **setup.synthetic,
        device=setup.rank_device(rank),
        dtype=dtype,
        context=setup.context,
        exl3_mode=setup.exl3_mode,
    )


def _follower_main(rank: int, setup: RankSetup, parent: int) -> None:
    """A spawned rank: watch rank 0's process, join, load, follow; exit non-zero on any error."""
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        join_group(setup, rank)
        model, _ = load_shard(setup, rank)
        states = local_states(sequence_states(model.spec), model.module)
    except Exception as exc:  # rank 0 names this rank from its exit status; say why here
        print(f"trellis: tensor-parallel rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    try:
        follow(model.module, states, model.device)
        dist.destroy_process_group()
    except RuntimeError:  # a collective failed: another rank went away, which rank 0 reports
        os._exit(LOST_PEER_STATUS)
    except Exception as exc:
        print(f"trellis: tensor-parallel rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)


def _watch_parent(parent: int) -> None:
    """Exit when rank 0's process is gone (this process was re-parented)."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(POLL_S)


def _how(exitcode: int) -> str:
    if exitcode == LOST_PEER_STATUS:
        return "lost contact with another rank"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed ({name})"
    return f"exited with status {exitcode}"


class TensorParallelRun:
    """Rank 0's handle on the other ranks: their processes, the watchdog, shutting down."""

    def __init__(self, processes: list, exit_on_failure: bool, grouped: bool | None = None) -> None:
        """``grouped``: this process is in the run's process group (default: where there are
        other ranks; a test's run of one rank may make one too)."""
        self.processes = processes  # rank r's process at index r - 1
        self.exit_on_failure = exit_on_failure
        self.grouped = bool(processes) if grouped is None else grouped
        self.failure: RankFailedError | None = None
        self._closing = False
        self._surfaced = threading.Event()  # rank 0's main thread raised the failure
        if processes:  # a run of one rank has nothing to watch
            self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
            self._watchdog.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def _watch(self) -> None:
        while not self._closing:
            ended = [
                (rank, p.exitcode) for rank, p in enumerate(self.processes, start=1) if p.exitcode is not None
            ]
            if ended and not self._closing:
                # Name a rank that ended for a reason of its own, not one that lost contact with it.
                rank, code = min(ended, key=lambda e: (e[1] == LOST_PEER_STATUS, e[0]))
                self._fail(RankFailedError(rank, _how(code)))
                return
            time.sleep(POLL_S)

    def _fail(self, failure: RankFailedError) -> None:
        self.failure = failure
        for process in self.processes:  # the others may be blocked in a collective with it
            if process.exitcode is None:
                process.kill()
        if self._surfaced.wait(FAILURE_GRACE_S) or not self.exit_on_failure or self._closing:
            return
        # Rank 0 is blocked in a collective that has not noticed: end the process, with the news.
        print(f"error: {failure}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)

    def translate(self, exc: BaseException) -> BaseException:
        """The error rank 0's failed collective stands for: the rank that ended, once the
        watchdog has seen which (it polls every ``POLL_S``)."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(POLL_S / 2)
        if self.failure is None:
            return exc
        self._surfaced.set()
        return self.failure

    def close(self, abort: bool = False) -> None:
        """Tell the other ranks to stop, wait for them and leave the process group. ``abort``
        (rank 0 failed, perhaps between a step's collectives): end them instead, since a stop
        message would not pair with the collective they wait in."""
        global _current
        if self._closing:
            return
        self._closing = True
        if _current is self:
            _current = None
        if not self.grouped:  # one rank: no process group was made
            return
        if self.processes and self.failure is None and not abort:
            try:
                messages.send(Stop())
            except RuntimeError:
                abort = True
        for process in self.processes:
            if abort and process.exitcode is None:
                process.kill()
            process.join(timeout=10)
            if process.exitcode is None:
                process.kill()
                process.join()
        messages.close_channel()
        if dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> TensorParallelRun:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close(abort=error is not None)


# The run this process leads, until it is closed (see start_tensor_parallel).
_current: TensorParallelRun | None = None


def _set_current(run: TensorParallelRun) -> None:
    global _current
    _current = run


def start_tensor_parallel(
    directory: str | Path | None,
    world: int,
    device: str | None = "auto",
    dtype: str | None = None,
    context: int | None = None,
    exl3_mode: str | None = None,
    options: EngineOptions | None = None,
    timeout_s: float = 300.0,
    exit_on_failure: bool = False,
    synthetic: dict | None = None,
    group_of_one: bool = False,
) -> tuple[LoadedModel, TensorParallelRun, ShardReport]:
    """Start ``world`` ranks over the model in ``directory``; this process becomes rank 0.

    ``device``: ``cpu``, ``cuda`` (rank ``r`` on GPU ``r``) or ``auto`` (CUDA where there are
    ``world`` GPUs). ``timeout_s`` bounds every collective inside a step. ``exit_on_failure``:
    end this process when a rank dies and rank 0 cannot be woken otherwise (a command line's
    choice, not a library's). ``world`` 1 is the single-process model (:func:`load_model`), with a
    run that has nothing to close. ``synthetic``: random weights of a shape instead of
    ``directory`` (the arguments of ``engine.loading.synthetic_store.synthetic_model``).
    ``group_of_one`` (tests, not a user option): with ``world`` 1, make the process group (NCCL
    on CUDA) and shard all the same, so that one device runs the tensor-parallel path, its
    collectives and their capture in CUDA graphs included. The caller closes the run
    (:meth:`TensorParallelRun.close`, or ``with run:``, which ends the other ranks at once where
    its block raised) when done.
    """
    if world < 1:
        raise UsageError(f"--tp takes a number of ranks >= 1, got {world}")
    kind = _device_kind(device, world)
    where = "" if directory is None else str(directory)
    setup = RankSetup(
        where,
        world,
        free_port(),
        kind,
        dtype,
        exl3_mode,
        context,
        options,
        timeout_s,
        synthetic,
        group_of_one,
    )
    if not setup.sharded:  # the single-process model itself: no processes, no process group, no collectives
        if synthetic is not None:
            return _synthetic(setup, 0), TensorParallelRun([], exit_on_failure), ShardReport()
        model = load_model(
            directory, device=kind, dtype=dtype, context=context, exl3_mode=exl3_mode, options=options
        )
        return model, TensorParallelRun([], exit_on_failure), ShardReport()
    # One run per process (the process group is the process's): a run its owner dropped without
    # closing it ends here, rather than leaving the next one unable to make its group.
    if _current is not None:
        _current.close(abort=True)
    context_mp = mp.get_context("spawn")
    processes = []
    for rank in range(1, world):
        process = context_mp.Process(target=_follower_main, args=(rank, setup, os.getpid()), daemon=True)
        process.start()
        processes.append(process)
    run = TensorParallelRun(processes, exit_on_failure, grouped=True)
    _set_current(run)
    try:
        join_group(setup, 0)
        model, report = load_shard(setup, 0)
    except BaseException as exc:
        failure = run.translate(exc) if isinstance(exc, RuntimeError) else exc
        run.close(abort=True)
        if failure is exc:
            raise
        raise failure from exc
    states = local_states(sequence_states(model.spec), model.module)
    model = replace(model, module=LeaderModule(model.module, run.translate), cache_states=states)
    return model, run, report


def _device_kind(device: str | None, world: int) -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "cpu"
    if device not in ("cpu", "cuda"):
        raise UsageError(f"tensor parallelism runs on 'cpu' or 'cuda' (one GPU per rank), not '{device}'")
    if device == "cuda" and torch.cuda.device_count() < world:
        raise UsageError(f"--tp {world} needs {world} GPUs; {torch.cuda.device_count()} are visible")
    return device

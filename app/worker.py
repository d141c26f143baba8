"""The engine, on its own thread, behind queued signals.

``EngineWorker`` is a QObject moved to a ``QThread``; its slots run there, so loading a model or
generating never blocks the GUI. It is the only place in ``app/`` that touches the engine
runtime, through ``engine.api.SessionProtocol``; it imports the runtime lazily inside its slots
(``engine.session``, ``engine.starter``), so the GUI starts fast, runs without torch until a model
is loaded, and tests can inject a scripted fake through ``session_factory``/``starter_factory``.
Prompt policy (images, chat template, fitting to the context) is the session's, not the worker's.
A model of a remote endpoint (a ``remote:`` reference, ``app.remote``) loads as a
``RemoteSession``, which speaks the same protocol over HTTP. While the loaded model is served
(``start_serving``, ``app.serve.host``), the HTTP server's engine loop drives its Generator and the
worker's own replies go through that loop too.

``EngineClient`` is the GUI-side handle: it owns the thread, turns method calls into queued
signal emissions, and re-emits the worker's signals (``EngineSignals``, declared once for both).
Everything it emits arrives on the GUI thread, which is the only thread allowed to touch Qt item
models, and the client's own state (what is loaded, which replies run) is kept there too.

Messages are ``engine.api.ChatMessage`` dicts; their ``"images"`` are bytes, which are immutable,
so they cross the thread boundary safely (the store stays on the GUI thread). Requests, model
info and stats are frozen dataclasses, safe to share for the same reason.

Cancellation is not a queued call (it would wait behind the generation it wants to stop): the GUI
thread adds the request id to a set the generation loop checks on every chunk, and the session's
``should_stop`` callback reads the same set.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.library.parallel_choice import ParallelChoice
from app.remote.refs import is_remote_ref, split_ref
from engine.api import ChatMessage, GenerationRequest, ModelInfo, ReplyStats, SessionProtocol, StreamChunk
from engine.errors import EngineError

log = logging.getLogger(__name__)

ProgressFn = Callable[[float, str], None]
CacheBits = tuple[int, int]
StarterFactory = Callable[[Path, ProgressFn], Path]
# Opens a remote model (app.remote): its reference (app.remote.refs) and the load's progress.
RemoteFactory = Callable[[str, ProgressFn], SessionProtocol]


# Share of the load's progress bar for reading the model; the rest is the warm-up.
LOAD_SHARE = 0.9


class SessionFactory(Protocol):
    def __call__(
        self,
        model_dir: str,
        device: str,
        progress: ProgressFn,
        cache_bits: CacheBits = (16, 16),
        context: int | None = None,
    ) -> SessionProtocol: ...


def _default_session_factory(
    model_dir: str,
    device: str,
    progress: ProgressFn,
    cache_bits: CacheBits = (16, 16),
    context: int | None = None,
    parallel: ParallelChoice | None = None,
) -> SessionProtocol:
    from engine.options import EngineOptions
    from engine.session import ChatSession  # lazy: pulls in torch

    # The app has no engine settings of its own; the development switches still apply, and the
    # users' default drafter (n-gram on the CPU; TRELLIS_DRAFT chooses another).
    options = EngineOptions.from_environment().with_front_end_draft()
    if parallel is not None and not parallel.is_single:
        from engine.parallel.session import ParallelChatSession  # starts the other ranks

        return ParallelChatSession.load_parallel(
            model_dir,
            parallel.gpus,
            parallel.split_layers or None,
            device=device,
            progress=progress,
            cache_tokens=context,
            cache_bits=cache_bits,
            options=options,
            experts_on=parallel.experts_on,
            gpu_layers=parallel.gpu_layers,
        )
    return ChatSession.load(
        model_dir,
        device=device,
        progress=progress,
        cache_tokens=context,
        cache_bits=cache_bits,
        options=options,
    )


def _default_starter_factory(models_dir: Path, progress: ProgressFn) -> Path:
    from engine.starter import ensure_starter_model  # lazy: pulls in the GGUF importer

    return ensure_starter_model(models_dir, progress=progress)


def _default_remote_factory(ref: str, progress: ProgressFn) -> SessionProtocol:
    from app.remote.session import RemoteSession  # lazy: the HTTP client

    return RemoteSession.open(ref, progress)


def _is_out_of_memory(exc: BaseException) -> bool:
    # Checked by name so this module never needs torch: torch.OutOfMemoryError (and the older
    # torch.cuda.OutOfMemoryError) or a RuntimeError/MemoryError whose text says so.
    return (
        type(exc).__name__ == "OutOfMemoryError"
        or isinstance(exc, MemoryError)
        or "out of memory" in str(exc).lower()
    )


def describe_error(exc: BaseException, doing: str) -> str:
    """A message a user can act on, for an exception raised while ``doing`` something."""
    if _is_out_of_memory(exc):
        return (
            f"Out of memory while {doing}. Try a smaller or more quantized model, a shorter "
            "conversation or fewer max tokens, or close other programs using memory."
        )
    if isinstance(exc, EngineError):
        return f"Could not finish {doing}: {exc}"
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").startswith("engine"):
        return f"Could not finish {doing}: this build of Trellis Chat lacks the engine module {exc.name}."
    if isinstance(exc, FileNotFoundError):
        return f"Could not finish {doing}: file not found ({exc.filename or exc})."
    return f"Could not finish {doing}: unexpected {type(exc).__name__}: {exc}"


class EngineSignals(QObject):
    """What the engine thread reports; the worker emits these and the client re-emits them."""

    loadProgress = Signal(float, str)
    loaded = Signal(object)  # ModelInfo
    loadFailed = Signal(str)
    unloaded = Signal()
    chunk = Signal(int, str)  # request id, new text
    prefillProgress = Signal(int, int, int)  # request id, prompt tokens read, to read
    generationFinished = Signal(int, object)  # request id, ReplyStats (stop_reason "error" on failure)
    tokensCounted = Signal(int, int)  # request id, count
    starterProgress = Signal(float, str)
    starterReady = Signal(str)
    starterFailed = Signal(str)
    error = Signal(str)  # every failure, as a human message
    serveStarted = Signal(str)  # the local server's base URL (http://127.0.0.1:PORT/v1)
    serveStopped = Signal(str)  # why it stopped ("" when asked to)
    serveFailed = Signal(str)  # why it could not start


class EngineWorker(EngineSignals):
    """Runs in the engine thread. Construct on the GUI thread, then ``moveToThread``."""

    def __init__(
        self,
        session_factory: SessionFactory | None = None,
        starter_factory: StarterFactory | None = None,
        remote_factory: RemoteFactory | None = None,
    ) -> None:
        super().__init__()
        self._session_factory = session_factory or _default_session_factory
        self._starter_factory = starter_factory or _default_starter_factory
        self._remote_factory = remote_factory or _default_remote_factory
        self._session: SessionProtocol | None = None
        self._server = None  # app.serve.host.LocalServer while the loaded model is served
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()

    # -- called from the GUI thread --------------------------------------------------------------

    def cancel(self, request_id: int) -> None:
        """Thread-safe: the running (or still queued) generation ``request_id`` stops at its next chunk."""
        with self._lock:
            self._cancelled.add(request_id)

    def _is_cancelled(self, request_id: int) -> bool:
        with self._lock:
            return request_id in self._cancelled

    # -- slots (engine thread) -------------------------------------------------------------------

    @Slot(str, str, object, object, object)
    def load(
        self,
        model_dir: str,
        device: str,
        cache_bits: Sequence[int] = (16, 16),
        context: int | None = None,
        parallel: ParallelChoice | None = None,
    ) -> None:
        """Load, then warm up (the first reply's one-time costs, paid here behind the progress
        bar rather than in silence after the first Send); ``loaded`` comes after both.
        ``parallel``: how to spread the model over several GPUs, or over the GPU and system memory
        (None: one device)."""
        if self._session is not None:
            self._unload_session()
        bits = (int(cache_bits[0]), int(cache_bits[1]))
        try:
            self.loadProgress.emit(0.0, "Loading model")

            def progress(fraction: float, message: str) -> None:
                self.loadProgress.emit(LOAD_SHARE * fraction, message)

            if is_remote_ref(model_dir):  # a model of a remote endpoint: same protocol, over HTTP
                self._session = self._remote_factory(model_dir, progress)
            elif parallel is not None and not parallel.is_single:
                self._session = self._session_factory(
                    model_dir, device, progress, cache_bits=bits, context=context, parallel=parallel
                )
            else:
                self._session = self._session_factory(
                    model_dir, device, progress, cache_bits=bits, context=context
                )
            self.loadProgress.emit(LOAD_SHARE, "Warming up")
            self._session.warm_up()
            info = ModelInfo.of(self._session, model_dir, bits)
        except Exception as exc:
            log.warning("load failed: %s", traceback.format_exc())
            self._session = None
            gc.collect()
            name = split_ref(model_dir)[1] if is_remote_ref(model_dir) else Path(model_dir).name
            message = describe_error(exc, f"loading {name}")
            self.error.emit(message)  # first, so listeners of loadFailed already have it
            self.loadFailed.emit(message)
            return
        self.loadProgress.emit(1.0, "Loaded")
        self.loaded.emit(info)

    @Slot()
    def unload(self) -> None:
        self._unload_session()
        self.unloaded.emit()

    @Slot(int)
    def start_serving(self, port: int) -> None:
        """Serve the loaded model on 127.0.0.1:``port`` (the app's chats share its engine)."""
        if self._server is not None:
            self.serveStarted.emit(self._server.base_url)
            return
        if self._session is None:
            self.serveFailed.emit("Load a model first: the server serves the loaded model.")
            return
        try:
            from app.serve.host import LocalServer  # lazy: the server stack

            self._server = LocalServer(self._session, port).start()
        except Exception as exc:
            log.warning("serving failed: %s", traceback.format_exc())
            self._server = None
            self.serveFailed.emit(f"Could not serve the model on port {port}: {exc}")
            return
        log.info("serving the loaded model at %s", self._server.base_url)
        self.serveStarted.emit(self._server.base_url)

    @Slot()
    def stop_serving(self, reason: str = "") -> None:
        server, self._server = self._server, None
        if server is None:
            return
        try:
            server.close()
        except Exception as exc:  # stopping must never take the app down
            log.warning("stopping the server failed: %s", exc)
        self.serveStopped.emit(reason)

    def _unload_session(self) -> None:
        self.stop_serving("The model was unloaded; the server stopped.")
        session, self._session = self._session, None
        if session is None:
            return
        try:
            session.unload()
        except Exception as exc:  # unloading must never take the app down
            self.error.emit(describe_error(exc, "unloading the model"))
        del session
        gc.collect()

    @Slot(int, object, bool)
    def count_tokens(self, request_id: int, messages: list[ChatMessage], completion: bool = False) -> None:
        if self._session is None:
            return
        try:
            self.tokensCounted.emit(request_id, self._session.count_tokens(messages, completion))
        except Exception as exc:
            log.info("count_tokens failed: %s", exc)  # the meter just keeps its old value

    @Slot(int, object, object)
    def generate(self, request_id: int, messages: list[ChatMessage], request: GenerationRequest) -> None:
        started = time.perf_counter()
        last: StreamChunk | None = None
        calls: list[dict] = []  # the reply's tool calls, as they complete
        stop_reason, error = "", ""
        try:
            if self._session is None:
                raise EngineError("no model is loaded; load one from the model bar or the library")
            if not self._is_cancelled(request_id):
                stream = self._session.stream(
                    messages,
                    request,
                    lambda: self._is_cancelled(request_id),
                    on_prefill=lambda done, total: self.prefillProgress.emit(request_id, done, total),
                )
                with closing(stream):
                    for last in stream:
                        if last.text:
                            self.chunk.emit(request_id, last.text)
                        calls.extend(last.tool_calls)
                        if last.done:
                            stop_reason = last.stop_reason or "eos"
                            # A constrained reply that cannot be finished validly keeps its text so
                            # far (stop reason "constraint_error"); the reason goes with it.
                            if last.error:
                                error = f"The reply does not fit the JSON schema: {last.error}"
                                self.error.emit(error)
                            break
                        if self._is_cancelled(request_id):
                            break  # the session should have stopped through should_stop
            if not stop_reason:
                stop_reason = "cancelled" if self._is_cancelled(request_id) else "eos"
        except Exception as exc:
            log.warning("generation failed: %s", traceback.format_exc())
            stop_reason, error = "error", describe_error(exc, "the reply")
            self.error.emit(error)
        finally:
            with self._lock:
                self._cancelled.discard(request_id)
        stats = ReplyStats.of(stop_reason, last, time.perf_counter() - started, error)
        if calls:
            stats = replace(stats, tool_calls=tuple(calls))
        self.generationFinished.emit(request_id, stats)

    @Slot(str)
    def install_starter(self, models_dir: str) -> None:
        try:
            path = self._starter_factory(Path(models_dir), self.starterProgress.emit)
        except Exception as exc:
            log.warning("starter install failed: %s", traceback.format_exc())
            message = describe_error(exc, "installing the starter model")
            self.error.emit(message)
            self.starterFailed.emit(message)
            return
        self.starterReady.emit(str(path))

    @Slot()
    def shutdown(self) -> None:
        self._unload_session()


def _folder_key(path: str | Path) -> str:
    if is_remote_ref(str(path)):
        return str(path)
    return str(Path(path).resolve())


# Signals that change what the client knows; it updates its state before re-emitting them.
_STATEFUL = ("loaded", "loadFailed", "unloaded", "generationFinished")
_RELAYED = [
    name for name, value in vars(EngineSignals).items() if isinstance(value, Signal) and name not in _STATEFUL
]


class EngineClient(EngineSignals):
    """GUI-thread facade over an ``EngineWorker`` in its own ``QThread``."""

    # A load was asked for (GUI side only: what showed the previous model goes stale now).
    loadStarted = Signal(str)

    # Requests: queued across the thread boundary because the worker lives in the other thread.
    _requestLoad = Signal(str, str, object, object, object)
    _requestUnload = Signal()
    _requestGenerate = Signal(int, object, object)
    _requestCount = Signal(int, object, bool)
    _requestStarter = Signal(str)
    _requestShutdown = Signal()
    _requestServe = Signal(int)
    _requestStopServing = Signal()

    def __init__(
        self,
        session_factory: SessionFactory | None = None,
        starter_factory: StarterFactory | None = None,
        parent: QObject | None = None,
        remote_factory: RemoteFactory | None = None,
    ) -> None:
        super().__init__(parent)
        self._thread = QThread()
        self._thread.setObjectName("engine")
        self.worker = EngineWorker(session_factory, starter_factory, remote_factory)
        self.worker.moveToThread(self._thread)
        self._next_id = 0
        self.model_info: ModelInfo | None = None
        self.loading = False
        # What the last load asked for (folder, device, cache bits, context, parallel choice)
        # while it is in flight or loaded: asking again for the same is a no-op rather than a
        # reload that would cancel the replies sent to it meanwhile.
        self._load_request: tuple[str, str, CacheBits, int | None, ParallelChoice | None] | None = None
        self.active_requests: set[int] = set()

        self._requestLoad.connect(self.worker.load)
        self._requestUnload.connect(self.worker.unload)
        self._requestGenerate.connect(self.worker.generate)
        self._requestCount.connect(self.worker.count_tokens)
        self._requestStarter.connect(self.worker.install_starter)
        self._requestShutdown.connect(self.worker.shutdown)
        self._requestServe.connect(self.worker.start_serving)
        self._requestStopServing.connect(self.worker.stop_serving)
        # The client lives in the GUI thread, so these connections are queued: each arrives there.
        for name in _RELAYED:
            getattr(self.worker, name).connect(getattr(self, name))
        self.worker.loaded.connect(self._on_loaded)
        self.worker.loadFailed.connect(self._on_load_failed)
        self.worker.unloaded.connect(self._on_unloaded)
        self.worker.generationFinished.connect(self._on_generation_finished)
        self._thread.start()

    # -- state kept on the GUI thread --------------------------------------------------------------

    def _on_loaded(self, info: ModelInfo) -> None:
        self.loading = False
        self.model_info = info
        self.loaded.emit(info)

    def _on_load_failed(self, message: str) -> None:
        self.loading = False
        self._load_request = None
        self.model_info = None
        self.loadFailed.emit(message)

    def _on_unloaded(self) -> None:
        self._load_request = None
        self.model_info = None
        self.unloaded.emit()

    def _on_generation_finished(self, request_id: int, stats: ReplyStats) -> None:
        self.active_requests.discard(request_id)
        self.generationFinished.emit(request_id, stats)

    @property
    def is_loaded(self) -> bool:
        return self.model_info is not None

    # -- requests ----------------------------------------------------------------------------------

    def load(
        self,
        model_dir: str | Path,
        device: str = "auto",
        cache_bits: Sequence[int] = (16, 16),
        context: int | None = None,
        parallel: ParallelChoice | None = None,
    ) -> None:
        """Load a model; ``cache_bits`` are the KV cache's key and value widths (16: unquantized),
        ``context`` the tokens of context to allocate (None: the engine's default), ``parallel``
        how to spread it over several GPUs or over the GPU and system memory (None: one device)."""
        bits = (int(cache_bits[0]), int(cache_bits[1]))
        parallel = None if parallel is None or parallel.is_single else parallel
        self.loading = True
        self._load_request = (_folder_key(model_dir), device, bits, context, parallel)
        self.model_info = None
        self.loadStarted.emit(str(model_dir))
        self._requestLoad.emit(str(model_dir), device, bits, context, parallel)

    def load_target(self) -> str | None:
        """The folder (resolved) of the model loaded or loading; None when there is none."""
        if self._load_request is None or not (self.loading or self.model_info is not None):
            return None
        return self._load_request[0]

    def has_load(
        self,
        model_dir: str | Path,
        device: str,
        cache_bits: Sequence[int],
        context: int | None = None,
        parallel: ParallelChoice | None = None,
    ) -> bool:
        """Whether exactly this load is in flight or done (and not unloaded or failed since)."""
        parallel = None if parallel is None or parallel.is_single else parallel
        bits = (int(cache_bits[0]), int(cache_bits[1]))
        wanted = (_folder_key(model_dir), device, bits, context, parallel)
        return self._load_request == wanted and (self.loading or self.model_info is not None)

    def unload(self) -> None:
        for request_id in list(self.active_requests):
            self.worker.cancel(request_id)
        self._requestUnload.emit()

    def generate(self, messages: Sequence[ChatMessage], request: GenerationRequest) -> int:
        """Queue a reply to ``messages``; returns its request id (chunks and the finish carry it)."""
        self._next_id += 1
        request_id = self._next_id
        self.active_requests.add(request_id)
        self._requestGenerate.emit(request_id, list(messages), request)
        return request_id

    def cancel(self, request_id: int) -> None:
        self.worker.cancel(request_id)

    def count_tokens(self, messages: Sequence[ChatMessage], completion: bool = False) -> int:
        """Count ``messages`` as the loaded model would be sent them (``completion``: as plain
        text); the answer comes as ``tokensCounted`` with the returned id."""
        self._next_id += 1
        self._requestCount.emit(self._next_id, list(messages), completion)
        return self._next_id

    def install_starter(self, models_dir: str | Path) -> None:
        self._requestStarter.emit(str(models_dir))

    def start_serving(self, port: int) -> None:
        """Serve the loaded model on 127.0.0.1:``port``: ``serveStarted(url)`` or ``serveFailed(why)``."""
        self._requestServe.emit(int(port))

    def stop_serving(self) -> None:
        self._requestStopServing.emit()

    def shutdown(self, timeout_ms: int = 10000) -> None:
        """Stop generations, unload, and join the thread (called when the window closes)."""
        if not self._thread.isRunning():
            return
        for request_id in list(self.active_requests):
            self.worker.cancel(request_id)
        self._requestShutdown.emit()
        self._thread.quit()
        self._thread.wait(timeout_ms)

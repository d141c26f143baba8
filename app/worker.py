"""The engine, on its own thread, behind queued signals.

``EngineWorker`` is a QObject moved to a ``QThread``; its slots run there, so loading a model or
generating never blocks the GUI. It is the only place in ``app/`` that touches the engine
runtime, and it imports it lazily inside its slots (``engine.session``, ``engine.starter``), so
the GUI starts fast, runs without torch until a model is loaded, and tests can inject a scripted
fake through ``session_factory``/``starter_factory``.

``EngineClient`` is the GUI-side handle: it owns the thread, turns method calls into queued
signal emissions, and re-exposes the worker's signals. Everything it emits arrives on the GUI
thread, which is the only thread allowed to touch Qt item models.

Images: a message dict may carry ``"images"``, the encoded bytes of its attached images in order
(bytes are immutable, so they cross the thread boundary safely; the store stays on the GUI
thread). The worker turns such messages into the engine's content parts (``{"type": "image"}``
parts first, then the text) for a model that sees images, and leaves the images out, saying how
many, for one that does not; a *new* message with images for such a model is refused instead.

Cancellation is not a queued call (it would wait behind the generation it wants to stop): the GUI
thread adds the request id to a set the generation loop checks on every chunk, and the engine's
``should_stop`` callback reads the same set.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal, Slot

from engine.errors import EngineError

log = logging.getLogger(__name__)

ProgressFn = Callable[[float, str], None]
# (model_dir, device, progress, cache_bits=(key bits, value bits)) -> a ChatSession-like object
SessionFactory = Callable[..., Any]
StarterFactory = Callable[[Path, ProgressFn], Path]
# JSON schema text -> the engine's Constraint (raises ConstraintError for a schema it refuses)
ConstraintFactory = Callable[[str], Any]
CacheBits = tuple[int, int]


def _default_session_factory(
    model_dir: str, device: str, progress: ProgressFn, cache_bits: CacheBits = (16, 16)
) -> Any:
    from engine.session import ChatSession  # lazy: pulls in torch

    return ChatSession.load(model_dir, device=device, progress=progress, cache_bits=cache_bits)


def _default_starter_factory(models_dir: Path, progress: ProgressFn) -> Path:
    from engine.starter import ensure_starter_model  # lazy: pulls in the GGUF importer

    return ensure_starter_model(models_dir, progress=progress)


def _default_constraint_factory(schema_text: str) -> Any:
    from engine.generation.constraints import json_schema  # lazy: pulls in torch and formatron

    return json_schema(schema_text)


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


def _sampling_settings(values: dict[str, Any]) -> Any:
    """Build the engine's SamplingSettings from a plain dict, ignoring keys it does not know."""
    from dataclasses import fields

    from engine.generation.sampling import SamplingSettings

    known = {f.name for f in fields(SamplingSettings)}
    settings = SamplingSettings(**{k: v for k, v in values.items() if k in known})
    settings.validate()  # a bad value is named before any model work
    return settings


def fit_to_context(
    session: Any,
    messages: list[dict],
    max_new_tokens: int,
    count: Callable[[list[dict]], int] | None = None,
) -> tuple[list[dict], int, int]:
    """Make a conversation fit the model's context: leave out the oldest turns (never the system
    prompt or the newest message) until prompt + reply fit, then cap the reply at what is left.
    ``count`` gives a prompt's length in tokens (default: the session's ``count_tokens``).

    Returns (messages, max_new_tokens, number of messages left out). If even the system prompt and
    the last message do not fit, they are passed on unchanged and the engine's
    ContextOverflowError explains it.
    """
    limit = int(getattr(session, "context_length", 0) or 0)
    if count is None:
        if not hasattr(session, "count_tokens"):
            return messages, max_new_tokens, 0
        count = session.count_tokens
    if limit <= 0:
        return messages, max_new_tokens, 0
    kept = list(messages)
    dropped = 0
    # Reserve room for a reply, but never more than half the context (a huge max_new_tokens
    # should shorten the reply, not erase the conversation).
    reserve = min(max_new_tokens, limit // 2)
    prompt = count(kept)
    while prompt + reserve > limit:
        oldest = next((i for i, m in enumerate(kept[:-1]) if m["role"] != "system"), None)
        if oldest is None:
            break
        del kept[oldest]
        dropped += 1
        prompt = count(kept)
    if prompt < limit:
        max_new_tokens = min(max_new_tokens, limit - prompt)
    return kept, max_new_tokens, dropped


def with_image_parts(messages: list[dict]) -> tuple[list[dict], list[bytes]]:
    """The engine's form of a chat with images: a message with images gets content parts (one
    ``{"type": "image"}`` per image, then the text, the order the engine's prompt builder and the
    chat templates expect), and the images come back as one list in prompt order."""
    out: list[dict] = []
    images: list[bytes] = []
    for message in messages:
        attached = list(message.get("images") or ())
        if attached:
            parts: list[dict] = [{"type": "image"} for _ in attached]
            parts.append({"type": "text", "text": message["content"]})
            out.append({"role": message["role"], "content": parts})
            images.extend(attached)
        else:
            out.append({"role": message["role"], "content": message["content"]})
    return out, images


def without_images(messages: list[dict]) -> tuple[list[dict], int]:
    """Plain text messages, and how many images were left out."""
    left_out = sum(len(m.get("images") or ()) for m in messages)
    return [{"role": m["role"], "content": m["content"]} for m in messages], left_out


def has_images(messages: list[dict]) -> bool:
    return any(m.get("images") for m in messages)


class EngineWorker(QObject):
    """Runs in the engine thread. Construct on the GUI thread, then ``moveToThread``."""

    loadProgress = Signal(float, str)
    # dict: name, path, context_length, memory_bytes, device, sees_images, cache_bits
    loaded = Signal(object)
    loadFailed = Signal(str)
    unloaded = Signal()
    chunk = Signal(int, str)  # request id, new text
    generationFinished = Signal(int, object)  # request id, stats dict (stop_reason "error" on failure)
    tokensCounted = Signal(int, int)  # request id, count
    starterProgress = Signal(float, str)
    starterReady = Signal(str)
    starterFailed = Signal(str)
    error = Signal(str)  # every failure, as a human message

    def __init__(
        self,
        session_factory: SessionFactory | None = None,
        starter_factory: StarterFactory | None = None,
        sampling_factory: Callable[[dict[str, Any]], Any] | None = None,
        constraint_factory: ConstraintFactory | None = None,
    ) -> None:
        super().__init__()
        self._session_factory = session_factory or _default_session_factory
        self._starter_factory = starter_factory or _default_starter_factory
        self._sampling_factory = sampling_factory or _sampling_settings
        self._constraint_factory = constraint_factory or _default_constraint_factory
        self._session: Any = None
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

    @Slot(str, str, object)
    def load(self, model_dir: str, device: str, cache_bits: Sequence[int] = (16, 16)) -> None:
        if self._session is not None:
            self._unload_session()
        bits = (int(cache_bits[0]), int(cache_bits[1]))
        try:
            self.loadProgress.emit(0.0, "Loading model")
            session = self._session_factory(model_dir, device, self.loadProgress.emit, cache_bits=bits)
            self._session = session
            info = {
                "name": getattr(session, "model_name", Path(model_dir).name),
                "path": model_dir,
                "context_length": int(getattr(session, "context_length", 0) or 0),
                "memory_bytes": int(session.memory_bytes()) if hasattr(session, "memory_bytes") else 0,
                "device": str(getattr(session, "device", device)),
                "sees_images": bool(getattr(session, "sees_images", False)),
                "cache_bits": bits,
            }
        except Exception as exc:
            log.warning("load failed: %s", traceback.format_exc())
            self._session = None
            gc.collect()
            message = describe_error(exc, f"loading {Path(model_dir).name}")
            self.error.emit(message)  # first, so listeners of loadFailed already have it
            self.loadFailed.emit(message)
            return
        self.loadProgress.emit(1.0, "Loaded")
        self.loaded.emit(info)

    @Slot()
    def unload(self) -> None:
        self._unload_session()
        self.unloaded.emit()

    def _unload_session(self) -> None:
        session, self._session = self._session, None
        if session is None:
            return
        try:
            session.unload()
        except Exception as exc:  # unloading must never take the app down
            self.error.emit(describe_error(exc, "unloading the model"))
        del session
        gc.collect()

    @Slot(int, object)
    def count_tokens(self, request_id: int, messages: list[dict]) -> None:
        session = self._session
        if session is None:
            return
        try:
            if has_images(messages) and getattr(session, "sees_images", False):
                # Images expand to hundreds of tokens each; only the engine knows how many. The
                # vision tower's own cache keeps this from encoding the same picture twice.
                ids, _media = session.encode_chat_with_images(*with_image_parts(messages))
                count = len(ids)
            else:
                count = int(session.count_tokens(without_images(messages)[0]))
            self.tokensCounted.emit(request_id, count)
        except Exception as exc:
            log.info("count_tokens failed: %s", exc)  # the meter just keeps its old value

    @Slot(int, object, object, int, object, str)
    def generate(
        self,
        request_id: int,
        messages: list[dict],
        sampling: dict[str, Any],
        max_new_tokens: int,
        stop_strings: Sequence[str],
        json_schema: str = "",
    ) -> None:
        """``json_schema`` (text; "" = none): the reply must be one JSON document valid under it."""
        stats: dict[str, Any] = {
            "stop_reason": None,
            "prompt_tokens": 0,
            "new_tokens": 0,
            "tokens_per_second": 0.0,
        }
        started = time.perf_counter()
        try:
            if self._session is None:
                raise EngineError("no model is loaded; load one from the model bar or the library")
            if self._is_cancelled(request_id):
                stats["stop_reason"] = "cancelled"
            else:
                settings = self._sampling_factory(dict(sampling))
                # Built before any model work, so an invalid schema fails at once (ConstraintError,
                # an EngineError: describe_error turns it into a readable message).
                constraint = self._constraint_factory(json_schema) if json_schema.strip() else None
                stream = self._start_stream(
                    request_id, messages, settings, max_new_tokens, tuple(stop_strings), stats, constraint
                )
                for chunk in stream:
                    if chunk.text:
                        self.chunk.emit(request_id, chunk.text)
                    stats.update(
                        prompt_tokens=chunk.prompt_tokens,
                        new_tokens=chunk.new_tokens,
                        tokens_per_second=float(chunk.tokens_per_second),
                    )
                    if chunk.done:
                        stats["stop_reason"] = chunk.stop_reason
                        # A constrained reply that cannot be finished validly says why; its text so
                        # far is kept (stop reason "constraint_error"), the message goes with it.
                        if getattr(chunk, "error", None):
                            stats["error"] = f"The reply does not fit the JSON schema: {chunk.error}"
                            self.error.emit(stats["error"])
                        break
                    if self._is_cancelled(request_id):
                        # The engine should have stopped through should_stop; do not rely on it.
                        stats["stop_reason"] = "cancelled"
                        close = getattr(stream, "close", None)
                        if close is not None:
                            close()
                        break
                if stats["stop_reason"] is None:
                    stats["stop_reason"] = "cancelled" if self._is_cancelled(request_id) else "eos"
        except Exception as exc:
            log.warning("generation failed: %s", traceback.format_exc())
            message = describe_error(exc, "the reply")
            stats.update(stop_reason="error", error=message)
            self.error.emit(message)
        finally:
            with self._lock:
                self._cancelled.discard(request_id)
        stats["seconds"] = time.perf_counter() - started
        self.generationFinished.emit(request_id, stats)

    def _start_stream(
        self,
        request_id: int,
        messages: list[dict],
        settings: Any,
        max_new_tokens: int,
        stop_strings: tuple[str, ...],
        stats: dict[str, Any],
        constraint: Any = None,
    ) -> Any:
        """Fit the conversation to the context and start the engine's stream: text only through
        ``stream_chat``; with images through ``encode_chat_with_images`` and ``stream_ids``."""
        session = self._session
        should_stop = lambda: self._is_cancelled(request_id)  # noqa: E731
        # Passed only when set, so sessions without constrained output keep working unchanged.
        extra: dict[str, Any] = {"constraint": constraint} if constraint is not None else {}
        if not getattr(session, "sees_images", False) and has_images(messages):
            if messages[-1].get("images"):
                # The GUI refuses this before sending; a model swapped in meanwhile lands here.
                raise EngineError(
                    f"{getattr(session, 'model_name', 'this model')} cannot see images; load a "
                    "vision model or send the message without its images"
                )
            messages, left_out = without_images(messages)
            stats["images_left_out"] = left_out
        if not has_images(messages):
            messages, max_new_tokens, dropped = fit_to_context(
                session, without_images(messages)[0], max_new_tokens
            )
            if dropped:
                stats["trimmed_messages"] = dropped
            return session.stream_chat(
                messages,
                settings,
                max_new_tokens=max_new_tokens,
                stop_strings=stop_strings,
                should_stop=should_stop,
                **extra,
            )
        # Counting a prompt with images means encoding it (the images' token counts depend on
        # their sizes), so remember the last encoding: the one that fits is the one we send.
        encoded: dict[tuple[int, ...], tuple[list[int], Any]] = {}

        def encode(msgs: list[dict]) -> tuple[list[int], Any]:
            key = tuple(map(id, msgs))
            if key not in encoded:
                encoded.clear()
                encoded[key] = session.encode_chat_with_images(*with_image_parts(msgs))
            return encoded[key]

        messages, max_new_tokens, dropped = fit_to_context(
            session, messages, max_new_tokens, count=lambda msgs: len(encode(msgs)[0])
        )
        if dropped:
            stats["trimmed_messages"] = dropped
        ids, media = encode(messages)
        return session.stream_ids(
            ids, settings, max_new_tokens, stop_strings, should_stop=should_stop, media=media, **extra
        )

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
    return str(Path(path).resolve())


def _to_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return dict(value)
    if is_dataclass(value):
        return asdict(value)
    return dict(vars(value))


class EngineClient(QObject):
    """GUI-thread facade over an ``EngineWorker`` in its own ``QThread``."""

    # Requests: queued across the thread boundary because the worker lives in the other thread.
    _requestLoad = Signal(str, str, object)
    _requestUnload = Signal()
    _requestGenerate = Signal(int, object, object, int, object, str)
    _requestCount = Signal(int, object)
    _requestStarter = Signal(str)
    _requestShutdown = Signal()

    # Re-exposed worker signals (delivered on the GUI thread).
    loadProgress = Signal(float, str)
    loaded = Signal(object)
    loadFailed = Signal(str)
    unloaded = Signal()
    chunk = Signal(int, str)
    generationFinished = Signal(int, object)
    tokensCounted = Signal(int, int)
    starterProgress = Signal(float, str)
    starterReady = Signal(str)
    starterFailed = Signal(str)
    error = Signal(str)

    def __init__(
        self,
        session_factory: SessionFactory | None = None,
        starter_factory: StarterFactory | None = None,
        sampling_factory: Callable[[dict[str, Any]], Any] | None = None,
        parent: QObject | None = None,
        constraint_factory: ConstraintFactory | None = None,
    ) -> None:
        super().__init__(parent)
        self._thread = QThread()
        self._thread.setObjectName("engine")
        self.worker = EngineWorker(session_factory, starter_factory, sampling_factory, constraint_factory)
        self.worker.moveToThread(self._thread)
        self._next_id = 0
        self.model_info: dict[str, Any] | None = None
        self.loading = False
        # What the last load asked for (folder, device, cache bits) while it is in flight or
        # loaded: asking again for the same is a no-op rather than a reload that would cancel
        # the replies sent to it meanwhile.
        self._load_request: tuple[str, str, tuple[int, int]] | None = None
        self.active_requests: set[int] = set()

        self._requestLoad.connect(self.worker.load)
        self._requestUnload.connect(self.worker.unload)
        self._requestGenerate.connect(self.worker.generate)
        self._requestCount.connect(self.worker.count_tokens)
        self._requestStarter.connect(self.worker.install_starter)
        self._requestShutdown.connect(self.worker.shutdown)
        for name in (
            "loadProgress",
            "chunk",
            "tokensCounted",
            "starterProgress",
            "starterReady",
            "starterFailed",
            "error",
        ):
            getattr(self.worker, name).connect(getattr(self, name))
        self.worker.loaded.connect(self._on_loaded)
        self.worker.loadFailed.connect(self._on_load_failed)
        self.worker.unloaded.connect(self._on_unloaded)
        self.worker.generationFinished.connect(self._on_generation_finished)
        self._thread.start()

    # -- state kept on the GUI thread --------------------------------------------------------------

    def _on_loaded(self, info: dict) -> None:
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

    def _on_generation_finished(self, request_id: int, stats: dict) -> None:
        self.active_requests.discard(request_id)
        self.generationFinished.emit(request_id, stats)

    @property
    def is_loaded(self) -> bool:
        return self.model_info is not None

    # -- requests ----------------------------------------------------------------------------------

    def load(self, model_dir: str | Path, device: str = "auto", cache_bits: Sequence[int] = (16, 16)) -> None:
        """Load a model; ``cache_bits`` are the KV cache's key and value widths (16: unquantized)."""
        bits = (int(cache_bits[0]), int(cache_bits[1]))
        self.loading = True
        self._load_request = (_folder_key(model_dir), device, bits)
        self.model_info = None
        self._requestLoad.emit(str(model_dir), device, bits)

    def has_load(self, model_dir: str | Path, device: str, cache_bits: Sequence[int]) -> bool:
        """Whether exactly this load is in flight or done (and not unloaded or failed since)."""
        wanted = (_folder_key(model_dir), device, (int(cache_bits[0]), int(cache_bits[1])))
        return self._load_request == wanted and (self.loading or self.model_info is not None)

    def unload(self) -> None:
        for request_id in list(self.active_requests):
            self.worker.cancel(request_id)
        self._requestUnload.emit()

    def generate(
        self,
        messages: list[dict],
        sampling: Any,
        max_new_tokens: int = 512,
        stop_strings: Sequence[str] = (),
        json_schema: str = "",
    ) -> int:
        """Queue a generation; returns its request id (chunks and the finish carry it).
        ``json_schema``: JSON schema text the reply must follow ("" = free text)."""
        self._next_id += 1
        request_id = self._next_id
        self.active_requests.add(request_id)
        self._requestGenerate.emit(
            request_id,
            list(messages),
            _to_dict(sampling),
            int(max_new_tokens),
            list(stop_strings),
            json_schema,
        )
        return request_id

    def cancel(self, request_id: int) -> None:
        self.worker.cancel(request_id)

    def count_tokens(self, messages: list[dict]) -> int:
        self._next_id += 1
        self._requestCount.emit(self._next_id, list(messages))
        return self._next_id

    def install_starter(self, models_dir: str | Path) -> None:
        self._requestStarter.emit(str(models_dir))

    def shutdown(self, timeout_ms: int = 10000) -> None:
        """Stop generations, unload, and join the thread (called when the window closes)."""
        if not self._thread.isRunning():
            return
        for request_id in list(self.active_requests):
            self.worker.cancel(request_id)
        self._requestShutdown.emit()
        self._thread.quit()
        self._thread.wait(timeout_ms)

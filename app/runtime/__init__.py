"""The managed GPU runtime of the double-click bundle (packaging/GPU_RUNTIME.md).

The bundle ships the CPU build of torch. Where an NVIDIA GPU is present, the app offers to
download the CUDA build of torch (a few GB) into ``<data dir>/runtime/`` and, from the next start
on, imports torch from there. One concept per module:

- :mod:`~app.runtime.lock`: the lock files (``locks/runtime-<variant>.lock.json``): every wheel
  of one runtime with its URL, size and SHA-256;
- :mod:`~app.runtime.variant`: which lock fits this machine's NVIDIA driver;
- :mod:`~app.runtime.install`: download (resume, verify, retry), disk-space check, unpack, the
  ``current`` marker written last;
- :mod:`~app.runtime.activate`: at startup, before torch is imported, put the installed runtime
  on ``sys.path`` (or say why not and keep the bundled CPU torch);
- :mod:`~app.runtime.cli`: ``trellis-chat --install-gpu-runtime``, the same install without a
  window;
- :mod:`~app.runtime.dialog` and :mod:`~app.runtime.offer`: the Qt side, the first-run offer
  and its progress dialog.

Everything but the last two is free of Qt and of torch: the activation runs before either loads.
"""

"""Before the QApplication exists: can Qt open a window here, and if not, why not?

Qt's xcb platform plugin (X11) needs a dozen system libraries that a pip install cannot bring.
Without one of them Qt aborts the process (SIGABRT) with a message that names the wrong library,
so the launcher asks the system's dynamic loader itself, first, and turns the answer into the
package names and the install command for the user's distribution. With no display at all the
windowed app cannot start either; the headless modes (``--ask``, ``--about``) then run on Qt's
offscreen platform instead.

Nothing here imports Qt: it must run before Qt can abort.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

# soname -> (Debian/Ubuntu, Fedora, Arch) package. Every library Qt's xcb plugin and its
# XcbQpa library link against that a desktop may lack, plus libxcb-cursor, which Qt 6.5+
# opens at run time (it is not a link dependency, so the loader's list never shows it).
PACKAGES: dict[str, tuple[str, str, str]] = {
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm", "xcb-util-wm"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms", "xcb-util-keysyms"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image", "xcb-util-image"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil", "xcb-util-renderutil"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util", "xcb-util"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11", "libxkbcommon-x11"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon", "libxkbcommon"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb", "libxcb"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb", "libxcb"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb", "libxcb"),
    "libxcb-xinput.so.0": ("libxcb-xinput0", "libxcb", "libxcb"),
    "libxcb-glx.so.0": ("libxcb-glx0", "libxcb", "libxcb"),
    "libxcb.so.1": ("libxcb1", "libxcb", "libxcb"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb", "libx11"),
    "libX11.so.6": ("libx11-6", "libX11", "libx11"),
    "libSM.so.6": ("libsm6", "libSM", "libsm"),
    "libICE.so.6": ("libice6", "libICE", "libice"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl", "libglvnd"),
    "libGL.so.1": ("libgl1", "libglvnd-glx", "libglvnd"),
    "libOpenGL.so.0": ("libopengl0", "libglvnd-opengl", "libglvnd"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig", "fontconfig"),
    "libfreetype.so.6": ("libfreetype6", "freetype", "freetype2"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs", "dbus"),
    "libglib-2.0.so.0": ("libglib2.0-0", "glib2", "glib2"),
}

INSTALLERS = (
    ("Debian/Ubuntu", "sudo apt-get install -y"),
    ("Fedora", "sudo dnf install -y"),
    ("Arch", "sudo pacman -S --needed"),
)

_NOT_FOUND = re.compile(r"^\s*(\S+)\s*=>\s*not found", re.MULTILINE)


@dataclass(frozen=True)
class DisplayCheck:
    """The outcome: the Qt platform to force (None: Qt's own choice) or why no window can open."""

    platform: str | None = None
    problem: str = ""


def xcb_plugin() -> Path | None:
    """PySide6's xcb platform plugin, found without importing Qt."""
    spec = importlib.util.find_spec("PySide6")
    for root in (spec.submodule_search_locations or []) if spec else []:
        plugin = Path(root) / "Qt" / "plugins" / "platforms" / "libqxcb.so"
        if plugin.is_file():
            return plugin
    return None


def missing_libraries(plugin: Path, ldd: str | None = None) -> list[str]:
    """The sonames the dynamic loader cannot find for ``plugin`` (and what it loads at run time).

    ``ldd`` lists every missing library at once; where it is absent, loading the plugin names
    the first one the loader trips on, which is still the right message to give."""
    missing: list[str] = []
    ldd = ldd if ldd is not None else shutil.which("ldd")
    if ldd:
        result = subprocess.run([ldd, str(plugin)], capture_output=True, text=True, timeout=30)
        missing = list(dict.fromkeys(_NOT_FOUND.findall(result.stdout)))
    else:
        try:
            ctypes.CDLL(str(plugin))
        except OSError as exc:
            found = re.search(r"(lib[\w.+-]+\.so[\w.]*)", str(exc))
            missing.append(found.group(1) if found else str(exc))
    if not _loadable("libxcb-cursor.so.0"):
        missing.append("libxcb-cursor.so.0")
    return missing


def _loadable(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)  # the same search dlopen() does for Qt
    except OSError:
        return False
    return True


def x_server_reachable(display: str, timeout_s: float = 2.0) -> bool:
    """Whether an X server accepts connections at ``display`` (":0", "unix:1.0", "host:10.0"):
    Qt aborts the process when it cannot connect, so the launcher tries first."""
    match = re.fullmatch(r"(?P<host>[^:]*):(?P<number>\d+)(?:\.\d+)?", display)
    if match is None:
        return False
    host, number = match.group("host"), int(match.group("number"))
    if host in ("", "unix"):
        # Xorg listens on the socket file and, on Linux, on the same name in the abstract namespace.
        path = f"/tmp/.X11-unix/X{number}"
        addresses: list[tuple[int, object]] = [(socket.AF_UNIX, path), (socket.AF_UNIX, "\0" + path)]
    else:
        addresses = [(socket.AF_INET, (host, 6000 + number))]
    return any(_connects(family, address, timeout_s) for family, address in addresses)


def _connects(family: int, address: object, timeout_s: float) -> bool:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(address)
    except OSError:
        return False
    return True


def install_advice(missing: list[str]) -> str:
    """The packages that provide ``missing``, as one install command per distribution family."""
    lines = []
    for index, (family, command) in enumerate(INSTALLERS):
        packages = []
        for soname in missing:
            package = PACKAGES.get(soname, (None, None, None))[index]
            packages.append(package or f"<the package providing {soname}>")
        lines.append(f"  {family}: {command} {' '.join(dict.fromkeys(packages))}")
    return "\n".join(lines)


def check(
    environ: Mapping[str, str] | None = None,
    *,
    headless: bool = False,
    platform: str = sys.platform,
    find_missing: Callable[[], list[str]] | None = None,
    reachable: Callable[[str], bool] | None = None,
) -> DisplayCheck:
    """Decide how Qt should start. ``headless``: the caller shows no window (``--ask``,
    ``--about``), so it runs on the offscreen platform wherever the user did not choose one."""
    env = os.environ if environ is None else environ
    chosen = env.get("QT_QPA_PLATFORM", "")
    if headless and not chosen:
        return DisplayCheck(platform="offscreen")
    if not platform.startswith("linux") or (chosen and not chosen.startswith("xcb")):
        return DisplayCheck()
    if env.get("WAYLAND_DISPLAY") and not chosen:
        return DisplayCheck()  # Qt picks its Wayland plugin, which needs none of xcb's libraries
    display = env.get("DISPLAY", "")
    if not display:
        return DisplayCheck(
            problem="Trellis Chat needs a graphical desktop: no display was found (DISPLAY and "
            "WAYLAND_DISPLAY are not set).\nStart it from a desktop session, or run "
            "`trellis-chat --ask QUESTION` / `trellis-chat --about`, which need no display."
        )
    if reachable is None:
        reachable = x_server_reachable
    if not reachable(display):
        return DisplayCheck(
            problem=f"Trellis Chat cannot reach the X display {display!r} (DISPLAY): no X server "
            "answers there.\nStart it from a desktop session, or check DISPLAY (over ssh: `ssh -X`)."
        )
    plugin = xcb_plugin()
    if find_missing is None:
        find_missing = (lambda: missing_libraries(plugin)) if plugin is not None else list
    missing = find_missing()
    if not missing:
        return DisplayCheck()
    return DisplayCheck(
        problem="Trellis Chat cannot open a window: Qt's X11 support needs system libraries "
        f"that are missing here: {', '.join(missing)}.\nInstall them with your package manager:\n"
        f"{install_advice(missing)}"
    )

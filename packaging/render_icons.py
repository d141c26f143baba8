"""Render resources/trellis-chat.svg to the PNG sizes of the hicolor icon theme and to the Windows
.ico (the macOS .icns is made from the same PNGs, see packaging/NOTES.md).

The rendered files are committed, so neither the desktop-entry installer nor a bundle build needs
an SVG renderer; rerun this after editing the SVG: ``python packaging/render_icons.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
ROOT = Path(__file__).resolve().parents[1]
RESOURCES = ROOT / "resources"


def render(svg: Path = RESOURCES / "trellis-chat.svg", out: Path = RESOURCES) -> list[Path]:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    _app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])  # noqa: F841 - keeps Qt up
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"{svg} is not a valid SVG")
    written = []
    for size in SIZES:
        image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
        image.fill(Qt.GlobalColor.transparent)
        painter = QPainter(image)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        renderer.render(painter)
        painter.end()
        target = out / "icons" / "hicolor" / f"{size}x{size}" / "apps" / "trellis-chat.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        image.save(str(target))
        written.append(target)
    from PIL import Image

    biggest = Image.open(out / "icons" / "hicolor" / "256x256" / "apps" / "trellis-chat.png")
    ico = out / "trellis-chat.ico"
    biggest.save(ico, sizes=[(s, s) for s in (16, 24, 32, 48, 64, 128, 256)])
    written.append(ico)
    return written


if __name__ == "__main__":
    for path in render():
        print(path.relative_to(ROOT))

"""Light and dark themes: follow the system's colour scheme unless the user picks one.

We use the Fusion style with an explicit palette in both modes, so the app looks the same on
every platform and dark mode also works where the platform style has none (offscreen, many Linux
desktops). The Markdown renderer gets matching colours.

Status colours (errors, muted notes) come from the theme too: a label says what it is with its
``role`` property ("error", "muted") and ``color_roles`` gives it the theme's colour in its
palette, at startup and on every theme switch. (Not an application style sheet: with one, fonts
set on a widget no longer reach its children, and the chat's font size setting is such a font.)
Each colour keeps a contrast of at least 4.5:1 (WCAG AA for normal text) against its theme's
window and base colours: the light theme's red is unreadable on the dark theme's grey.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont, QFontDatabase, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication, QLabel, QWidget

from app.chat.markdown import RenderTheme

# Spacing, in pixels: every margin and gap in the app is one of these steps, so panes line up.
SPACE_XS, SPACE_S, SPACE_M, SPACE_L, SPACE_XL = 4, 8, 12, 16, 24

# The type scale: each kind of text is the application font scaled by its factor (and weight), so
# the scale follows the user's font size.
TYPE_SCALE: dict[str, tuple[float, QFont.Weight]] = {
    "caption": (0.85, QFont.Weight.Normal),  # timestamps, statistics, secondary notes
    "body": (1.0, QFont.Weight.Normal),
    "label": (1.0, QFont.Weight.DemiBold),  # role names, list headers
    "title": (1.25, QFont.Weight.DemiBold),  # a pane's or conversation's title
    "display": (1.6, QFont.Weight.DemiBold),  # an empty state's headline
}

# Emoji in replies: a colour emoji font where the system has one (Qt falls back to whatever
# glyphs it finds otherwise, often none).
EMOJI_FAMILIES = ("Noto Color Emoji", "Apple Color Emoji", "Segoe UI Emoji", "Twemoji")

# The accent colour of avatars and the navigation rail's current item, per role: (light, dark).
ACCENT_COLORS = {
    "user": ("#2f6fde", "#5b8def"),
    "assistant": ("#0f8a5f", "#34b27b"),
    "system": ("#8e5bd8", "#a881e6"),
}


def font_for(kind: str, base: QFont) -> QFont:
    """``base`` (a widget's font) at the type scale's size and weight for ``kind``."""
    if kind not in TYPE_SCALE:
        raise ValueError(f"no text kind {kind!r} in the type scale (one of {', '.join(TYPE_SCALE)})")
    factor, weight = TYPE_SCALE[kind]
    font = QFont(base)
    if base.pointSizeF() > 0:
        font.setPointSizeF(base.pointSizeF() * factor)
    else:
        font.setPixelSize(max(1, round(base.pixelSize() * factor)))
    font.setWeight(weight)
    return font


def install_emoji_font() -> str | None:
    """Make the first installed colour emoji family Qt's emoji font; returns it, or None."""
    installed = set(QFontDatabase.families())
    for family in EMOJI_FAMILIES:
        if family in installed:
            if hasattr(QFontDatabase, "addApplicationEmojiFontFamily"):  # Qt 6.9+
                QFontDatabase.addApplicationEmojiFontFamily(family)
            else:  # older Qt: a fallback family of the application font
                font = QGuiApplication.font()
                font.setFamilies([*font.families(), family])
                QGuiApplication.setFont(font)
            return family
    return None


# (light theme, dark theme)
ERROR_COLORS = ("#b3261e", "#ff8a80")
MUTED_COLORS = ("#5f6368", "#a8adb4")


def error_color(dark: bool) -> str:
    return ERROR_COLORS[dark]


def muted_color(dark: bool) -> str:
    return MUTED_COLORS[dark]


ROLE_COLORS = {"error": ERROR_COLORS, "muted": MUTED_COLORS}


def color_roles(root: QWidget, dark: bool) -> None:
    """Give every label under ``root`` that has a ``role`` property its colour for the theme."""
    for label in [root, *root.findChildren(QLabel)]:
        colors = ROLE_COLORS.get(str(label.property("role") or ""))
        if colors is None or not isinstance(label, QLabel):
            continue
        palette = label.palette()
        palette.setColor(QPalette.ColorRole.WindowText, QColor(colors[dark]))
        label.setPalette(palette)


def system_prefers_dark() -> bool:
    hints = QGuiApplication.styleHints()
    return hasattr(hints, "colorScheme") and hints.colorScheme() == Qt.ColorScheme.Dark


def is_dark(mode: str) -> bool:
    if mode == "dark":
        return True
    if mode == "light":
        return False
    return system_prefers_dark()


def _palette(dark: bool) -> QPalette:
    p = QPalette()
    if dark:
        colors = {
            QPalette.ColorRole.Window: "#202124",
            QPalette.ColorRole.WindowText: "#e8eaed",
            QPalette.ColorRole.Base: "#17181a",
            QPalette.ColorRole.AlternateBase: "#2a2c30",
            QPalette.ColorRole.Text: "#e8eaed",
            QPalette.ColorRole.Button: "#2d2f33",
            QPalette.ColorRole.ButtonText: "#e8eaed",
            QPalette.ColorRole.Highlight: "#3d6fd8",
            QPalette.ColorRole.HighlightedText: "#ffffff",
            QPalette.ColorRole.ToolTipBase: "#2d2f33",
            QPalette.ColorRole.ToolTipText: "#e8eaed",
            QPalette.ColorRole.PlaceholderText: "#9aa0a6",
            QPalette.ColorRole.Link: "#8ab4f8",
            QPalette.ColorRole.Mid: "#3c4043",
        }
        disabled = "#6b6f75"
    else:
        colors = {
            QPalette.ColorRole.Window: "#f5f5f7",
            QPalette.ColorRole.WindowText: "#1d1d1f",
            QPalette.ColorRole.Base: "#ffffff",
            QPalette.ColorRole.AlternateBase: "#eef2f8",
            QPalette.ColorRole.Text: "#1d1d1f",
            QPalette.ColorRole.Button: "#e9e9ed",
            QPalette.ColorRole.ButtonText: "#1d1d1f",
            QPalette.ColorRole.Highlight: "#2f6fde",
            QPalette.ColorRole.HighlightedText: "#ffffff",
            QPalette.ColorRole.ToolTipBase: "#ffffe1",
            QPalette.ColorRole.ToolTipText: "#1d1d1f",
            QPalette.ColorRole.PlaceholderText: "#6e6e73",
            QPalette.ColorRole.Link: "#2563eb",
            QPalette.ColorRole.Mid: "#c7c7cc",
        }
        disabled = "#a1a1a6"
    for role, color in colors.items():
        p.setColor(role, QColor(color))
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText, QPalette.ColorRole.WindowText):
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor(disabled))
    return p


def apply_theme(app: QApplication, mode: str) -> bool:
    """Style the whole app for ``mode`` ("system", "light", "dark"); returns whether it is dark."""
    dark = is_dark(mode)
    app.setStyle("Fusion")
    install_emoji_font()
    app.setPalette(_palette(dark))
    return dark


def render_theme(dark: bool) -> RenderTheme:
    return RenderTheme.dark() if dark else RenderTheme()

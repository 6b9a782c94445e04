"""The app's resources (icon, style sheet), found with importlib.resources in the
`k3studio_resources` package -- the same lookup in a wheel, an editable install and a
PyInstaller bundle, never a path relative to the checkout (DESIGN "Resources")."""
from __future__ import annotations

import importlib.resources

from PySide6.QtCore import QByteArray, Qt
from PySide6.QtGui import QColor, QIcon, QPalette, QPixmap

PACKAGE = "k3studio_resources"


def _files():
    try:
        return importlib.resources.files(PACKAGE)
    except ModuleNotFoundError:
        return None


def read_bytes(name: str) -> bytes | None:
    root = _files()
    if root is None:
        return None
    res = root / name
    return res.read_bytes() if res.is_file() else None


THEMES = ("system", "light", "dark")


def style_sheet(dark: bool = False) -> str:
    data = read_bytes("style-dark.qss" if dark else "style.qss")
    return data.decode("utf-8") if data else ""


def system_is_dark() -> bool:
    """The platform's colour scheme (Qt >= 6.5); Unknown (e.g. Xvfb, offscreen) is light."""
    from PySide6.QtGui import QGuiApplication
    hints = QGuiApplication.styleHints()
    scheme = getattr(hints, "colorScheme", None)
    return scheme is not None and scheme() == Qt.ColorScheme.Dark


def is_dark(theme: str) -> bool:
    return theme == "dark" or (theme not in ("light", "dark") and system_is_dark())


def dark_palette() -> QPalette:
    p = QPalette()
    roles = {QPalette.Window: "#1e2128", QPalette.WindowText: "#e6e9f2",
             QPalette.Base: "#262a33", QPalette.AlternateBase: "#22252d",
             QPalette.ToolTipBase: "#2a2e38", QPalette.ToolTipText: "#e6e9f2",
             QPalette.Text: "#e6e9f2", QPalette.Button: "#2a2e38",
             QPalette.ButtonText: "#e6e9f2", QPalette.BrightText: "#ff7b72",
             QPalette.Link: "#7aa5ff", QPalette.Highlight: "#2f6fe0",
             QPalette.HighlightedText: "#ffffff", QPalette.PlaceholderText: "#7d8599",
             QPalette.Mid: "#3a3f4d", QPalette.Dark: "#15171c", QPalette.Shadow: "#0b0c0f",
             QPalette.Light: "#3a3f4d", QPalette.Midlight: "#30343f"}
    for role, colour in roles.items():
        p.setColor(role, QColor(colour))
    for role in (QPalette.Text, QPalette.ButtonText, QPalette.WindowText):
        p.setColor(QPalette.Disabled, role, QColor("#6c7386"))
    return p


def apply_theme(app, theme: str) -> bool:
    """Palette + style sheet for `theme` ("system", "light" or "dark"); returns dark?"""
    dark = is_dark(theme)
    app.setPalette(dark_palette() if dark else app.style().standardPalette())
    app.setStyleSheet(style_sheet(dark))
    return dark


def app_icon() -> QIcon:
    """The icon from the SVG (every size crisp), with the PNG as a fallback where the SVG
    image plugin is missing."""
    icon = QIcon()
    for name, fmt in (("k3studio.svg", "SVG"), ("k3studio.png", "PNG")):
        data = read_bytes(name)
        if not data:
            continue
        pm = QPixmap()
        if pm.loadFromData(QByteArray(data), fmt):
            if fmt == "SVG":
                for size in (16, 24, 32, 48, 64, 128, 256):
                    icon.addPixmap(pm.scaled(size, size))
            else:
                icon.addPixmap(pm)
            break
    return icon


def sheet_drawn_popups(root) -> None:
    """Give every drop-down under `root` a plain item delegate.  Qt's default one for a
    combo's popup draws each row as a menu item through the combo's own style-sheet rule
    (a bordered white box): the current row, "custom" in the preset list, showed as an
    empty box, its white selected text on white.  The plain delegate draws the rows from
    the sheet's `QComboBox QAbstractItemView` rules instead."""
    from PySide6.QtWidgets import QComboBox, QStyledItemDelegate
    for combo in root.findChildren(QComboBox):
        if not isinstance(combo.itemDelegate(), QStyledItemDelegate) or \
                type(combo.itemDelegate()).__name__ == "QComboMenuDelegate":
            combo.setItemDelegate(QStyledItemDelegate(combo))

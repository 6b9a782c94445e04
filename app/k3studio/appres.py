"""The app's resources (icon, style sheet), found with importlib.resources in the
`k3studio_resources` package -- the same lookup in a wheel, an editable install and a
PyInstaller bundle, never a path relative to the checkout (DESIGN "Resources")."""
from __future__ import annotations

import importlib.resources

from PySide6.QtCore import QByteArray
from PySide6.QtGui import QIcon, QPixmap

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


def style_sheet() -> str:
    data = read_bytes("style.qss")
    return data.decode("utf-8") if data else ""


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

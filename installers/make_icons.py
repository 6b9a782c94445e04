"""Make the platform icon files from resources/k3studio.png with Qt's own image writers
(PySide6 Essentials ships the ico and icns plugins), so no Pillow is needed at build time:

    python installers/make_icons.py OUTDIR            -> OUTDIR/k3studio.ico, OUTDIR/k3studio.icns

The .ico is for the Windows executable and installer, the .icns for the macOS app bundle.
Linux needs neither: the .desktop entry names the SVG/PNG installed into the icon theme.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "resources" / "k3studio.png"


def make_icons(out_dir: str | os.PathLike, formats: tuple[str, ...] = ("ico", "icns"),
               source: Path = SOURCE) -> list[Path]:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication, QImage, QImageWriter

    app = QGuiApplication.instance() or QGuiApplication([sys.argv[0]])  # noqa: F841 - plugins
    img = QImage(str(source))
    if img.isNull():
        raise SystemExit(f"make_icons: cannot read {source}")
    if img.width() != 256 or img.height() != 256:
        img = img.scaled(256, 256, Qt.KeepAspectRatio, Qt.SmoothTransformation)
    supported = {bytes(f).decode() for f in QImageWriter.supportedImageFormats()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fmt in formats:
        if fmt not in supported:
            raise SystemExit(f"make_icons: this Qt has no {fmt} image writer "
                             f"(has: {', '.join(sorted(supported))})")
        path = out / f"k3studio.{fmt}"
        w = QImageWriter(str(path), fmt.encode())
        if not w.write(img):
            raise SystemExit(f"make_icons: writing {path} failed: {w.errorString()}")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    formats = tuple(a.lstrip("-") for a in argv[1:]) or ("ico", "icns")
    for p in make_icons(argv[0], formats):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Names and metadata shared by the PyInstaller spec, the build scripts' checks, the
Windows (Inno Setup) and macOS recipes and their tests: one place, so the executable the
spec writes is the one the installers and launch checks look for.

Plain Python with no third-party import: the spec imports it at build time and the fast
tests import it without PyInstaller installed.
"""
from __future__ import annotations

import re
from pathlib import Path

INSTALLERS = Path(__file__).resolve().parent
REPO = INSTALLERS.parent

APP_NAME = "K3 Studio"            # what a person sees (menu entry, .app name, installer)
BUNDLE_DIR = "K3Studio"           # dist/K3Studio/, the one-folder bundle
GUI_EXE = "K3Studio"              # dist/K3Studio/K3Studio(.exe): the desktop app
CLI_EXE = "k3"                    # dist/K3Studio/k3(.exe): the command line, same engine
MACOS_APP = f"{APP_NAME}.app"     # dist/K3 Studio.app
BUNDLE_ID = "org.k3studio.K3Studio"
ICON_NAME = "k3studio"            # Icon= of resources/k3studio.desktop, file stem of the icons


def version() -> str:
    """The app's version, read from app/k3studio/__init__.py without importing it (that
    file is the single source: pyproject.toml's version is kept equal to it)."""
    text = (REPO / "app" / "k3studio" / "__init__.py").read_text(encoding="utf-8")
    m = re.search(r'^__version__\s*=\s*"([^"]+)"', text, re.M)
    if not m:
        raise RuntimeError("app/k3studio/__init__.py declares no __version__")
    return m.group(1)


def info_plist(ver: str | None = None) -> dict:
    """Info.plist entries for the macOS app bundle (PyInstaller's BUNDLE adds
    CFBundleExecutable, CFBundleIconFile and CFBundlePackageType itself)."""
    ver = ver or version()
    return {
        "CFBundleName": APP_NAME,
        "CFBundleDisplayName": APP_NAME,
        "CFBundleIdentifier": BUNDLE_ID,
        "CFBundleShortVersionString": ver,
        "CFBundleVersion": ver,
        "CFBundleInfoDictionaryVersion": "6.0",
        "LSApplicationCategoryType": "public.app-category.developer-tools",
        "LSMinimumSystemVersion": "11.0",
        "NSHighResolutionCapable": True,
        "NSRequiresAquaSystemAppearance": False,
        "NSHumanReadableCopyright": "Apache-2.0",
    }

"""K3 Studio: the desktop face of the k3engine (DESIGN.md).

The window is a thin composition of panels (one file each); the engine lives on one
QThread worker (`worker.py`) and the widgets only observe it through Qt signals carrying
plain values.  The app talks to k3engine through the same public API the `k3` CLI uses.
"""
__version__ = "0.1.0"
APP_NAME = "K3 Studio"
ORG_NAME = "K3 Studio"

"""k3engine: exact Kimi K3 inference (forward pass, checkpoint, streaming, CLI)."""
__version__ = "0.1.0"
REFERENCE_VERSION = "1.1.0"

"""PyInstaller entry point of the bundle's desktop app (dist/K3Studio/K3Studio): the same
`main` as the `k3-studio` gui-script and `python -m k3studio`."""
import sys

from k3studio.__main__ import main

if __name__ == "__main__":
    sys.exit(main())

"""PyInstaller entry point of the bundle's command line (dist/K3Studio/k3): the same
`main` as the `k3` console script and `python -m k3engine`."""
import sys

from k3engine.cli import main

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Build the one-folder K3 Studio bundle with PyInstaller: dist/K3Studio/{K3Studio,k3,_internal/}.
#
#   installers/build.sh                 isolated: make (or reuse) the build venv build/bundle-venv,
#                                       `pip install .` (compiles the Cython extension) and
#                                       PyInstaller into it, then build from it
#   installers/build.sh --current       build from the Python environment already active
#                                       (`python3` on PATH; the project installed in it, editable
#                                       or not); PyInstaller is pip-installed into it if missing
# Options:
#   --venv DIR      the isolated build venv (default build/bundle-venv; reused when present)
#   --python PY     interpreter that makes the build venv (default python3)
#   --dist DIR      output folder (default dist; the bundle is DIR/K3Studio)
#   --work DIR      PyInstaller's work folder (default build/pyinstaller)
#   --check         run installers/check_bundle.sh on the result
#
# PyInstaller is a build-time dependency only (DESIGN.md): it goes into the build venv, never
# into the project's dependencies, and nothing of the venv is needed to run the bundle.
# On macOS use installers/macos/build_app.sh (the same spec, plus the .app); on Windows see
# docs/installers.md.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
PYINSTALLER_REQ="${K3_PYINSTALLER_REQ:-pyinstaller>=6.10,<7}"

mode=isolated
venv="$REPO/build/bundle-venv"
python=python3
dist="$REPO/dist"
work="$REPO/build/pyinstaller"
check=0
while [ $# -gt 0 ]; do
  case "$1" in
    --current) mode=current ;;
    --venv) venv="$2"; shift ;;
    --python) python="$2"; shift ;;
    --dist) dist="$2"; shift ;;
    --work) work="$2"; shift ;;
    --check) check=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

case "$dist" in /*) ;; *) dist="$PWD/$dist" ;; esac
case "$work" in /*) ;; *) work="$PWD/$work" ;; esac
case "$venv" in /*) ;; *) venv="$PWD/$venv" ;; esac

if [ "$mode" = isolated ]; then
  if [ ! -x "$venv/bin/python" ]; then
    echo "+ $python -m venv $venv"
    "$python" -m venv "$venv"
  fi
  py="$venv/bin/python"
  echo "+ pip install $REPO $PYINSTALLER_REQ   (into $venv)"
  # Non-editable: the bundle takes the installed package with its compiled extension.
  "$py" -m pip install --upgrade --quiet pip
  "$py" -m pip install --quiet "$REPO" "$PYINSTALLER_REQ"
else
  py="$(command -v python3 || command -v python)"
  if ! "$py" -c "import PyInstaller" 2>/dev/null; then
    echo "+ pip install $PYINSTALLER_REQ   (into the current environment, $py)"
    "$py" -m pip install --quiet "$PYINSTALLER_REQ"
  fi
fi

"$py" - <<'EOF'
import sys
try:
    import k3engine.kernels._kernels, k3studio, k3studio_resources  # noqa: F401
except ImportError as e:
    sys.exit(f"build.sh: the project is not installed in {sys.executable} ({e}); "
             "pip install . first, or run without --current")
import PyInstaller
print(f"building with Python {sys.version.split()[0]} ({sys.executable}), "
      f"PyInstaller {PyInstaller.__version__}")
EOF

# cwd = an empty folder: `python -m` puts the cwd first on sys.path, and the spec's Analysis
# must find the *installed* packages, never a same-named folder (PyInstaller's own work
# folder is named after the spec: k3studio/).
mkdir -p "$dist" "$work/empty-cwd"
start=$(date +%s)
(cd "$work/empty-cwd" && "$py" -m PyInstaller --noconfirm --log-level WARN \
    --distpath "$dist" --workpath "$work" "$HERE/k3studio.spec")
bundle="$dist/K3Studio"
[ -x "$bundle/K3Studio" ] || [ -f "$bundle/K3Studio.exe" ] || {
  echo "build.sh: no executable in $bundle" >&2; exit 1; }

# The Linux desktop-entry installer rides along: run from the bundle it points the menu
# entry at this bundle's K3Studio and takes the icons from _internal/k3studio_resources.
case "$(uname -s)" in
  Linux) cp "$HERE/linux/install-desktop-entry.sh" "$bundle/" ;;
esac

echo "bundle: $bundle ($(du -sh "$bundle" | cut -f1), $(find "$bundle" -type f | wc -l) files," \
     "built in $(( $(date +%s) - start )) s)"
if [ "$check" = 1 ]; then
  "$HERE/check_bundle.sh" "$bundle"
fi

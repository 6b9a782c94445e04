#!/usr/bin/env bash
# macOS: build "dist/K3 Studio.app" (PyInstaller BUNDLE around the one-folder build, with the
# Info.plist of installers/bundle_meta.py and an .icns made from resources/k3studio.png),
# check it, and optionally pack it into a .dmg.
#
#   installers/macos/build_app.sh [--current] [--dmg] [--sign IDENTITY] [--dry-run]
#
#   --current        build from the active Python environment (see installers/build.sh)
#   --dmg            also write dist/K3Studio-<version>.dmg (hdiutil)
#   --sign ID        codesign the .app with this identity (default: PyInstaller's ad-hoc
#                    signature, enough to run on the machine that built it; distribution to
#                    other Macs needs a Developer ID identity and notarization, not done here)
#   --dry-run        print the steps without running them (works on any OS)
#
# Needs macOS 11+, the Xcode command line tools, Python 3.11+ and an OpenMP-capable C
# compiler for the Cython kernels: Apple's clang has no -fopenmp, so when CC is not set and
# Homebrew's llvm is installed (brew install llvm libomp) CC is pointed at its clang.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
INSTALLERS="$(cd "$HERE/.." && pwd)"
REPO="$(cd "$INSTALLERS/.." && pwd)"
APP_NAME="K3 Studio"
VERSION="$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$REPO/app/k3studio/__init__.py")"
APP="$REPO/dist/$APP_NAME.app"

build_args=()
dmg=0
sign=""
dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --current) build_args+=(--current) ;;
    --dmg) dmg=1 ;;
    --sign) sign="$2"; shift ;;
    --dry-run) dry=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build_app.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

run() { echo "+ $*"; if [ "$dry" = 0 ]; then "$@"; fi; }

if [ "$dry" = 0 ] && [ "$(uname -s)" != Darwin ]; then
  echo "build_app.sh: this builds a macOS .app and runs on macOS only (try --dry-run)" >&2
  exit 2
fi

# -- an OpenMP compiler for the kernels (setup.py passes -fopenmp) ------------------------------
if [ -z "${CC:-}" ] && [ "$dry" = 0 ]; then
  if ! echo 'int main(void){return 0;}' | clang -fopenmp -x c - -o /dev/null 2>/dev/null; then
    llvm="$(brew --prefix llvm 2>/dev/null || true)"
    if [ -n "$llvm" ] && [ -x "$llvm/bin/clang" ]; then
      export CC="$llvm/bin/clang"
      export LDFLAGS="-L$llvm/lib -Wl,-rpath,$llvm/lib ${LDFLAGS:-}"
      echo "using $CC for the OpenMP kernels"
    else
      echo "build_app.sh: Apple's clang cannot build the OpenMP kernels; install Homebrew's" \
           "llvm and libomp (brew install llvm libomp) or set CC to an OpenMP-capable compiler" >&2
      exit 1
    fi
  fi
fi

# -- the one-folder build; on macOS the spec's BUNDLE also writes the .app -----------------------
# (the empty-array form keeps macOS's bash 3.2 happy under set -u)
run "$INSTALLERS/build.sh" ${build_args[@]+"${build_args[@]}"}

# -- checks --------------------------------------------------------------------------------
run test -x "$APP/Contents/MacOS/K3Studio"
run test -x "$APP/Contents/MacOS/k3"
run plutil -lint "$APP/Contents/Info.plist"
if [ -n "$sign" ]; then
  run codesign --force --deep --options runtime --sign "$sign" "$APP"
fi
run codesign --verify --deep --strict "$APP"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/k3-app-check.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
run env QT_QPA_PLATFORM=offscreen "$APP/Contents/MacOS/K3Studio" --quit-after 3 \
    --data-dir "$tmp/data" --settings "$tmp/settings.ini"
run "$APP/Contents/MacOS/k3" --version

if [ "$dmg" = 1 ]; then
  run hdiutil create -volname "$APP_NAME" -srcfolder "$APP" -ov -format UDZO \
      "$REPO/dist/K3Studio-$VERSION.dmg"
fi
echo "app: $APP (version $VERSION)"

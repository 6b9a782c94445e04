#!/usr/bin/env bash
# Put K3 Studio into the desktop's application menu (per user, no root), or take it out.
#
#   install-desktop-entry.sh [--exec COMMAND] [--resources DIR]
#   install-desktop-entry.sh --uninstall
#
# Installs, under ${XDG_DATA_HOME:-~/.local/share}:
#   applications/k3studio.desktop                  (resources/k3studio.desktop, Exec= resolved)
#   icons/hicolor/scalable/apps/k3studio.svg
#   icons/hicolor/256x256/apps/k3studio.png
# and validates the entry with desktop-file-validate when that tool is installed (Debian:
# desktop-file-utils).
#
# Exec= gets, in order: --exec COMMAND; the K3Studio next to this script (the script is
# copied into the PyInstaller bundle by installers/build.sh); the absolute path of
# `k3-studio` on PATH (a venv's bin is rarely on the desktop session's PATH); else the
# entry's own `k3-studio`.  The icon and entry come from --resources DIR, else the
# checkout's resources/ or the bundle's _internal/k3studio_resources/.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DATA="${XDG_DATA_HOME:-$HOME/.local/share}"
APPS="$DATA/applications"
ICONS="$DATA/icons/hicolor"
ID=k3studio

mode=install
exec_cmd=""
res=""
while [ $# -gt 0 ]; do
  case "$1" in
    --uninstall) mode=uninstall ;;
    --exec) exec_cmd="$2"; shift ;;
    --resources) res="$2"; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "install-desktop-entry.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

refresh() {  # menu and icon caches, where the desktop has the tools; harmless without
  if command -v update-desktop-database >/dev/null; then update-desktop-database -q "$APPS" || true; fi
  touch "$ICONS" 2>/dev/null || true       # icon themes notice a changed directory mtime
  if [ -f "$ICONS/index.theme" ] && command -v gtk-update-icon-cache >/dev/null; then
    gtk-update-icon-cache -q -t "$ICONS" || true
  fi
}

if [ "$mode" = uninstall ]; then
  rm -f "$APPS/$ID.desktop" "$ICONS/scalable/apps/$ID.svg" "$ICONS/256x256/apps/$ID.png"
  for d in "$ICONS/scalable/apps" "$ICONS/scalable" "$ICONS/256x256/apps" "$ICONS/256x256"; do
    rmdir "$d" 2>/dev/null || true        # only when empty: other apps' icons stay
  done
  [ -d "$APPS" ] && refresh
  echo "removed K3 Studio's menu entry and icons from $DATA"
  exit 0
fi

if [ -z "$res" ]; then
  for d in "$HERE/../../resources" "$HERE/_internal/k3studio_resources"; do
    if [ -f "$d/$ID.desktop" ]; then res="$d"; break; fi
  done
fi
[ -n "$res" ] && [ -f "$res/$ID.desktop" ] || {
  echo "install-desktop-entry.sh: no $ID.desktop found (give --resources DIR)" >&2; exit 1; }
res="$(cd "$res" && pwd)"

if [ -z "$exec_cmd" ]; then
  if [ -x "$HERE/K3Studio" ]; then
    exec_cmd="$HERE/K3Studio"
  elif command -v k3-studio >/dev/null; then
    exec_cmd="$(command -v k3-studio)"
  fi
fi

# Exec= with a program path holding spaces or quotes must be quoted (Desktop Entry spec,
# "The Exec key"); the arguments after the program (field codes) are kept as they are.
quote_exec() {
  case "$1" in
    *[[:space:]\"\'\\\`\$]*) printf '"%s"' "$(printf '%s' "$1" | sed 's/[\\"`$]/\\&/g')" ;;
    *) printf '%s' "$1" ;;
  esac
}

mkdir -p "$APPS" "$ICONS/scalable/apps" "$ICONS/256x256/apps"
tmp="$(mktemp "$APPS/.$ID.desktop.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
if [ -n "$exec_cmd" ]; then
  prog="$(quote_exec "$exec_cmd")"
  # replace only the program (the first word) of Exec=, and TryExec= if present
  # (values through ENVIRON: awk -v would interpret the backslashes of a quoted path)
  PROG="$prog" RAW="$exec_cmd" awk '
    /^Exec=/    { rest = $0; sub(/^Exec=[^ ]*/, "", rest); print "Exec=" ENVIRON["PROG"] rest; next }
    /^TryExec=/ { print "TryExec=" ENVIRON["RAW"]; next }
    { print }' "$res/$ID.desktop" >"$tmp"
else
  cp "$res/$ID.desktop" "$tmp"
fi
chmod 644 "$tmp"

if command -v desktop-file-validate >/dev/null; then
  if ! out=$(desktop-file-validate "$tmp" 2>&1); then
    echo "install-desktop-entry.sh: desktop-file-validate rejects the entry:" >&2
    echo "$out" >&2; exit 1
  fi
  [ -z "$out" ] || echo "$out" | sed 's/^/desktop-file-validate: /'
  validated="validated with desktop-file-validate"
else
  validated="not validated: desktop-file-validate is not installed (desktop-file-utils)"
fi

mv -f "$tmp" "$APPS/$ID.desktop"
trap - EXIT
install -m 644 "$res/$ID.svg" "$ICONS/scalable/apps/$ID.svg"
install -m 644 "$res/$ID.png" "$ICONS/256x256/apps/$ID.png"
refresh
echo "installed $APPS/$ID.desktop ($validated)"
echo "  Exec=$(sed -n 's/^Exec=//p' "$APPS/$ID.desktop")"
echo "  icons in $ICONS/{scalable,256x256}/apps"

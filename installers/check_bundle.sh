#!/usr/bin/env bash
# Launch-check a built one-folder bundle, headless, in a clean environment (no venv, no
# PYTHONPATH, a temporary HOME): exit 0 only when every step below passes.
#
#   installers/check_bundle.sh [BUNDLE_DIR]        (default dist/K3Studio)
#
#   1. the files the app needs are inside: the compiled kernels, our tokenizer data, the
#      resources package, Qt's offscreen and xcb platform plugins and the svg image plugin
#   2. K3Studio --quit-after 3, QT_QPA_PLATFORM=offscreen, temp --data-dir and --settings:
#      exit 0 and no Python traceback on the console
#   3. K3Studio --demo --quit-after $K3_CHECK_DEMO_SECONDS (default 20): the demo model is made
#      in the temp data dir with its packed trunk, and the app exits 0 without a traceback
#   4. the bundle's k3: --version; make-checkpoint --dims demo; a prompt through the packaged
#      tokenizer, 4 tokens greedy incremental: exit 0 and a k3_run.json with 4 generated ids
#
# --quick runs 1 and 2 only.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bundle="$HERE/../dist/K3Studio"
quick=0
for a in "$@"; do
  case "$a" in
    --quick) quick=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "check_bundle.sh: unknown option $a" >&2; exit 2 ;;
    *) bundle="$a" ;;
  esac
done
bundle="$(cd "$bundle" && pwd)"
gui="$bundle/K3Studio"
cli="$bundle/k3"
internal="$bundle/_internal"

tmp="$(mktemp -d "${TMPDIR:-/tmp}/k3-bundle-check.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
fails=0
ok()   { echo "ok    $*"; }
bad()  { echo "FAIL  $*"; fails=$((fails + 1)); }

# A clean environment: whatever venv or PYTHONPATH the caller has must not be what makes
# the bundle work.
run_clean() {
  env -i PATH=/usr/bin:/bin HOME="$tmp/home" LANG=C.UTF-8 TMPDIR="$tmp" \
      XDG_RUNTIME_DIR="$tmp/run" QT_QPA_PLATFORM=offscreen "$@"
}
mkdir -p "$tmp/home" "$tmp/run" && chmod 700 "$tmp/run"

echo "checking $bundle ($(du -sh "$bundle" | cut -f1))"

# the desktop's own platform plugin besides offscreen
case "$(uname -s)" in
  Linux)  platform_plugins="PySide6/Qt/plugins/platforms/libqxcb.* PySide6/Qt/plugins/platforms/libqwayland.*" ;;
  Darwin) platform_plugins="PySide6/Qt/plugins/platforms/libqcocoa.*" ;;
  *)      platform_plugins="" ;;
esac

# -- 1. contents -----------------------------------------------------------------------------
for pattern in \
    "k3engine/kernels/_kernels.*" "k3engine/kernels/_k3z.*" \
    "k3engine/data/tokenizer/tiktoken.model" \
    "k3engine/data/tokenizer/tokenizer_config.json" \
    "k3studio_resources/k3studio.svg" "k3studio_resources/k3studio.png" \
    "k3studio_resources/style.qss" "k3studio_resources/k3studio.desktop" \
    "PySide6/Qt/plugins/platforms/libqoffscreen.*" \
    "PySide6/Qt/plugins/imageformats/libqsvg.*" \
    "regex/_regex.*" "tiktoken/_tiktoken.*" $platform_plugins; do
  # shellcheck disable=SC2086 # the pattern is meant to glob
  if compgen -G "$internal/$pattern" >/dev/null; then ok "contains $pattern"
  else bad "missing _internal/$pattern"; fi
done
for exe in "$gui" "$cli"; do
  [ -x "$exe" ] && ok "executable $(basename "$exe")" || bad "no executable $exe"
done

# -- 2. plain launch ---------------------------------------------------------------------------
launch() {  # launch NAME LOG ARGS...: K3Studio offscreen; exit code and traceback checked
  local name="$1" log="$2"; shift 2
  local t0=$SECONDS code=0
  run_clean "$gui" --settings "$tmp/$name.ini" --data-dir "$tmp/data-$name" "$@" \
      >"$log" 2>&1 || code=$?
  if [ "$code" = 0 ] && ! grep -q -E "Traceback|QThread: Destroyed" "$log"; then
    ok "K3Studio $* -> exit 0 in $((SECONDS - t0)) s"
  else
    bad "K3Studio $* -> exit $code"; sed 's/^/      | /' "$log" | tail -40
  fi
}
launch plain "$tmp/plain.log" --quit-after 3

if [ "$quick" = 0 ]; then
  # -- 3. the demo model, made and loaded by the bundled app ---------------------------------
  launch demo "$tmp/demo.log" --demo --quit-after "${K3_CHECK_DEMO_SECONDS:-20}"
  if [ -f "$tmp/data-demo/demo-model/config.json" ] && \
     [ -f "$tmp/data-demo/demo-model-trunk/trunk.json" ]; then
    ok "the demo model and its packed trunk were made in --data-dir" \
       "($(du -sh "$tmp/data-demo" | cut -f1))"
  else
    bad "no demo model in $tmp/data-demo"; sed 's/^/      | /' "$tmp/demo.log" | tail -20
  fi

  # -- 4. the command line ---------------------------------------------------------------------
  if out=$(run_clean "$cli" --version 2>&1); then ok "k3 --version: $out"
  else bad "k3 --version: $out"; fi
  if run_clean "$cli" make-checkpoint "$tmp/cli-demo" --dims demo >"$tmp/mk.log" 2>&1; then
    ok "k3 make-checkpoint --dims demo"
  else
    bad "k3 make-checkpoint"; tail -20 "$tmp/mk.log"
  fi
  if (cd "$tmp" && run_clean "$cli" "$tmp/cli-demo" --prompt "Hello" --tok "$tmp/cli-demo" \
        --gen 4 --incremental --out "$tmp/run.json" >"$tmp/run.log" 2>&1); then
    ids=$(grep -o '"generated_ids":\[[0-9,]*\]' "$tmp/run.json" 2>/dev/null || true)
    n=$(echo "${ids#*[}" | tr ',' '\n' | grep -c '[0-9]' || true)
    if [ "$n" = 4 ]; then ok "k3 DEMO --prompt Hello --gen 4 --incremental -> exit 0, $ids"
    else bad "k3 run: expected 4 generated ids in run.json, got '$ids'"; fi
  else
    bad "k3 run on the demo model"; tail -30 "$tmp/run.log"
  fi
fi

if [ "$fails" = 0 ]; then
  echo "bundle check passed"
else
  echo "bundle check: $fails failure(s)"; exit 1
fi

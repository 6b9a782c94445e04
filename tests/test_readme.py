"""The README's two commands are real: each is one line after its marker, CI runs the test
command exactly as written, and the quick-start command is run in a scratch copy of the
repository and opens K3 Studio on the demo model.

How the quick-start command is run (the substitutions are explicit and minimal; everything
else runs verbatim, through `bash -c` in the scratch copy):

* the scratch copy holds the files git knows (committed, staged or new and not ignored),
  as a fresh clone would, so no compiled extension or build/ directory rides along;
* offline and fast: instead of downloading the dependencies into the fresh venv (a minute
  or more, and the package index), the fresh venv sees the dependencies already installed
  for this test run through PYTHONPATH: a directory of symlinks to this interpreter's
  site-packages, less this checkout's own install and the .pth files.  PYTHONPATH and not
  `--system-site-packages`, because this run is itself usually in a venv, whose packages
  `--system-site-packages` would not show, and because PYTHONPATH comes before the fresh
  venv's own old setuptools/pip from ensurepip (Python 3.11's setuptools 65 cannot read
  pyproject's SPDX license string);
* `pip install -e .` becomes `pip install --no-deps --no-build-isolation -e .`, with
  PIP_NO_INDEX=1: still a real editable install of the scratch copy that compiles the Cython
  extension, with the build requirements (setuptools, wheel, Cython, numpy) taken from this
  environment.  Where this environment lacks them (Cython is not a runtime or test
  dependency), the build isolation stays and only the build requirements come from the
  package index: `pip install --no-deps -e .`;
* `python3` is this test run's interpreter (its directory first on PATH), HOME and the XDG
  directories are temporary, QT_QPA_PLATFORM=offscreen, and K3STUDIO_QUIT_AFTER makes the
  app quit by itself.

Then: the command exits 0, `k3-studio --demo` made the demo model and its packed trunk in
the per-user data directory, and the kernels imported by the fresh venv are the ones
compiled in the scratch copy.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
QUICKSTART, TESTCMD = "<!-- quickstart-command -->", "<!-- test-command -->"
# seconds the app stays open: it makes the demo model first (12 s was too short on a
# loaded 2-core machine)
QUIT_AFTER = os.environ.get("K3_README_QUIT_AFTER", "40")


def readme_command(marker: str) -> str:
    """The one line in the fenced block right after `marker`."""
    lines = README.read_text(encoding="utf-8").splitlines()
    where = [i for i, line in enumerate(lines) if line.strip() == marker]
    assert len(where) == 1, f"{marker} must appear exactly once in README.md"
    i = where[0]
    block = lines[i + 1:i + 4]
    assert len(block) == 3 and block[0].strip() == "```", \
        f"a ``` fence must follow {marker}: {block}"
    assert block[2].strip() == "```", f"the command after {marker} must be one line: {block}"
    cmd = block[1].strip()
    assert cmd and not cmd.endswith("\\") and not cmd.startswith("```"), cmd
    return cmd


def test_readme_has_both_commands():
    quick, test = readme_command(QUICKSTART), readme_command(TESTCMD)
    assert "pip install -e ." in quick and "k3-studio --demo" in quick
    assert "pip install -e '.[test]'" in test and "pytest" in test


def test_ci_runs_the_readme_test_command():
    """.ci/run takes the test command out of README.md itself and runs it with bash -c: its
    own extraction, evaluated here, must give exactly the README's command."""
    ci = (REPO / ".ci" / "run").read_text()
    live = [line for line in ci.splitlines() if not line.lstrip().startswith("#")]
    extract = [line for line in live if re.match(r"\s*cmd=\$\(", line)]
    assert len(extract) == 1, "expected one `cmd=$(...)` line in .ci/run"
    r = subprocess.run(["bash", "-c", f'set -euo pipefail; {extract[0]}; printf %s "$cmd"'],
                       cwd=REPO, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout == readme_command(TESTCMD)
    runs = [line.strip() for line in live if line.strip() == 'bash -c "$cmd"']
    assert runs == ['bash -c "$cmd"'], "'.ci/run' must run the extracted command once"
    assert live.index(next(line for line in live if line.strip() == 'bash -c "$cmd"')) > \
        live.index(extract[0])


def _scratch_copy(dest: Path) -> None:
    r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       cwd=REPO, capture_output=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"NOT RUN: not a git checkout ({r.stderr.decode().strip()})")
    for rel in filter(None, r.stdout.decode().split("\0")):
        src = REPO / rel
        if src.is_file():                         # a deleted file is still in the index
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _dependency_view(dest: Path) -> Path:
    """A directory of symlinks to what this environment's site-packages hold, less this
    checkout's own install (its editable finder would shadow the fresh one: same module
    name, and PYTHONPATH comes first) and less the .pth files (not processed there anyway)."""
    dest.mkdir()
    paths = sysconfig.get_paths()
    for site in dict.fromkeys([paths["purelib"], paths["platlib"]]):
        for entry in Path(site).iterdir():
            name = entry.name
            if (name.startswith("__editable__") or name.endswith(".pth")
                    or re.match(r"k3studio-[^-]+\.(dist|egg)-info$", name)
                    or name in ("k3engine", "k3studio", "k3studio_resources", "__pycache__")
                    or (dest / name).exists()):
                continue
            (dest / name).symlink_to(entry)
    return dest


def _have_build_requirements() -> bool:
    if any(importlib.util.find_spec(m) is None for m in ("setuptools", "wheel", "Cython",
                                                          "numpy")):
        return False
    import Cython
    import setuptools
    # pyproject's SPDX `license = "..."` string needs setuptools >= 77
    return (int(Cython.__version__.split(".")[0]) >= 3
            and int(setuptools.__version__.split(".")[0]) >= 77)


def test_quickstart_command(tmp_path):
    quick = readme_command(QUICKSTART)
    offline = _have_build_requirements()
    original = "pip install -e ."
    assert quick.count(original) == 1
    replacement = ("pip install --no-deps --no-build-isolation -e ." if offline
                   else "pip install --no-deps -e .")
    cmd = quick.replace(original, replacement)

    repo = tmp_path / "repo"
    _scratch_copy(repo)
    assert (repo / "pyproject.toml").is_file() and not list(repo.rglob("*.so"))
    home = tmp_path / "home"
    run_dir = tmp_path / "run"
    for d in (home, run_dir):
        d.mkdir()
    run_dir.chmod(0o700)
    deps = _dependency_view(tmp_path / "deps")
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    env.update({
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "PYTHONPATH": str(deps),
        "HOME": str(home),
        "XDG_DATA_HOME": str(tmp_path / "data"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "XDG_RUNTIME_DIR": str(run_dir),
        "QT_QPA_PLATFORM": "offscreen",
        "K3STUDIO_QUIT_AFTER": QUIT_AFTER,
        "PIP_NO_INPUT": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    })
    if offline:
        env["PIP_NO_INDEX"] = "1"
    print(f"+ (cd {repo} && bash -c {cmd!r})   "
          f"[{'offline' if offline else 'build requirements from the package index'}]")
    r = subprocess.run(["bash", "-c", cmd], cwd=repo, env=env, capture_output=True, text=True,
                       timeout=1200)
    log = f"--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}"
    assert r.returncode == 0, f"the quick-start command exited {r.returncode}\n{log}"
    assert "Traceback" not in r.stderr, log

    # the demo model, made by the app in its per-user data directory (under XDG_DATA_HOME)
    configs = list((tmp_path / "data").rglob("demo-model/config.json"))
    assert len(configs) == 1, f"no demo model under {tmp_path / 'data'}\n{log}"
    root = configs[0].parent.parent
    assert (root / "demo-model-trunk" / "trunk.json").is_file(), log
    print(f"demo model made in {root.relative_to(tmp_path)}")

    # the fresh venv imports the kernels compiled from the scratch copy
    probe = subprocess.run(
        [str(repo / ".venv" / "bin" / "python"), "-c",
         "import k3engine.kernels._kernels as k, k3studio, shutil; "
         "print(k.__file__); print(k3studio.__file__); print(shutil.which('k3-studio'))"],
        cwd=tmp_path, env={**env, "PATH": f"{repo / '.venv' / 'bin'}{os.pathsep}{env['PATH']}"},
        capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    ext, app, script = probe.stdout.split()
    assert Path(ext).resolve().is_relative_to(repo.resolve()), ext
    assert Path(app).resolve().is_relative_to(repo.resolve()), app
    assert Path(script).resolve() == (repo / ".venv" / "bin" / "k3-studio").resolve()

"""`k3 doctor [--model DIR] [--trunk DIR] [--tok DIR] [--scratch DIR]`: can this machine
and this install run the engine, which preset fits, and what to type next (SYSTEM §10.1).

It checks the installed engine (the compiled extension, its SIMD path, threads), memory
(the same probe the engine's admission check uses), storage as the engine reads it
(O_DIRECT random reads of expert-sized blocks), the model, trunk and tokenizer
directories, and then prints the exact next command.

Problems are warnings (exit 0): the point is a complete list, not the first failure.
Exit 1 only when the engine cannot run at all (its compiled extension does not import).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import platform
import re
import shlex
import sys
import time
from dataclasses import dataclass, field

from .. import __version__
from ..checkpoint import INDEX_JSON, INDEX_LIMIT, SUFFIX
from ..config import CONFIG_LIMIT
from ..inputfile import InputFileError, read_regular_file
from ..strict_json import JSONFormatError, loads_strict
from ..diskio import ALIGN
from ..memory import PRESETS, BudgetError, auto_budget, available_memory, human
from . import devbw

GiB = 1 << 30
# The reference's doctor keys these on MemAvailable in whole GB (integer division); we
# use the engine's own available figure (MemAvailable, or a tighter cgroup limit), since
# that is what admission will hold the run to.  Speeds: its table, released checkpoint.
PRESET_BY_MEMORY = ((192, "server", "~6"), (96, "workstation", "~6-20"),
                    (32, "desktop", "~24"), (10, "laptop", "~27"))
FLOOR_WARNING = ("under 10 GB available, below the floor for running the checkpoint "
                 "(~8.2 GB peak RSS)")
# Presets tried for the run line, largest first: the first whose plan this machine
# admits for the model at hand (a small generated model fits every one).
PRESET_ORDER = ("server", "workstation", "desktop", "laptop", "ultra")
FREE_FOR_DOWNLOAD = 1_700 * 10**9       # 1.56 TB checkpoint + 108.81 GB trunk, with room
PER_TOKEN_NOTE = ("the engine streams ~135 GB per token on the released checkpoint "
                  "(108.81 GB trunk + 25.83 GB of experts); storage is usually the ceiling")
PROBE_MB = 256
PROBE_SECONDS = 2.0                     # per queue depth
PROBE_DEPTHS = (1, 16)
PLAN_POSITIONS = 64                     # a short prompt and a few generated ids
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json")

# The released checkpoint's shard names and sizes (§1.1): every shard must match exactly.
RELEASED_SHARDS = 96
RELEASED_TOTAL = 1_560_936_091_448
_SHARD_NAME = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")


def released_shard_bytes(k: int) -> int:
    """Published size of shard k (1-based) of the released checkpoint."""
    if k == 1:
        return 2_341_216_112
    if k in (2, 3, 5, 6, 7, 9, 10):
        return 16_990_911_504
    if k in (4, 8):
        return 16_567_501_776
    if (12 <= k <= 92 and k % 4 == 0) or k == 93:
        return 16_567_507_176
    if 11 <= k <= 91:
        return 16_990_916_912
    return {94: 4_697_664_072, 95: 92_289_328, 96: 802_448_352}[k]


def recommend_preset(available: int) -> tuple[str | None, str]:
    """(preset, s/token note) keyed on available memory in whole GB, or (None, "")."""
    gb = available // GiB
    for threshold, name, speed in PRESET_BY_MEMORY:
        if gb >= threshold:
            return name, speed
    return None, ""


# --- the report ---------------------------------------------------------------------

class Report:
    def __init__(self, out=None):
        self.out = out or sys.stdout
        self.warnings: list[str] = []
        self.failures: list[str] = []

    def _line(self, tag: str, msg: str) -> None:
        print(f"  {tag:<5} {msg}", file=self.out)

    def section(self, title: str) -> None:
        print(f"\n{title}", file=self.out)

    def ok(self, msg: str) -> None:
        self._line("ok", msg)

    def info(self, msg: str) -> None:
        self._line("info", msg)

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)
        self._line("WARN", msg)

    def fail(self, msg: str) -> None:
        self.failures.append(msg)
        self._line("FAIL", msg)

    def plain(self, msg: str) -> None:
        print(msg, file=self.out)


# --- the shard set (no engine needed: file names, sizes, the HF index) ------------------

@dataclass
class ShardSet:
    present: list[str]                       # shard file names found
    expected: list[str] | None               # what a complete download holds, if knowable
    missing: list[str] = field(default_factory=list)
    wrong_size: list[tuple[str, int, int]] = field(default_factory=list)   # name, have, want
    released: bool = False                   # named like the released 96-shard checkpoint
    index_problem: str = ""


def shard_set(model_dir: str) -> ShardSet:
    """Which shard files a complete download has, from the `-of-N` names and the HF index
    (the engine never needs the index; a completeness check may use it, §1.1)."""
    present = sorted((n for n in os.listdir(model_dir) if n.endswith(SUFFIX)), key=os.fsencode)
    expected: set[str] = set()
    known = False
    matches = [m for m in map(_SHARD_NAME.match, present) if m]
    totals = {m.group(2) for m in matches}
    released = False
    # A name's "-of-N" is bounded (the engine indexes at most 65535 shards) before it sizes
    # the expected set: model-00001-of-99999999999.safetensors must not build 10^11 names.
    if matches and len(totals) == 1 and len(next(iter(totals))) <= 6 \
            and int(next(iter(totals))) <= 65535:
        total = totals.pop()
        width = len(matches[0].group(1))
        expected |= {f"model-{i:0{width}d}-of-{total}.safetensors"
                     for i in range(1, int(total) + 1)}
        known = True
        released = total == f"{RELEASED_SHARDS:06d}"     # the released 6-digit "000096"
    s = ShardSet(present, None, released=released)
    index = os.path.join(model_dir, INDEX_JSON)
    if os.path.exists(index):
        try:
            wm = loads_strict(read_regular_file(index, INDEX_LIMIT, "shard index"), index)["weight_map"]
            expected |= {v for v in wm.values() if isinstance(v, str)}
            known = True
        except (InputFileError, JSONFormatError) as e:
            s.index_problem = f"{index}: not a usable shard index ({e.problem})"
        except (KeyError, TypeError, AttributeError) as e:
            s.index_problem = f"{index}: not a usable shard index ({type(e).__name__}: {e})"
    if known:
        s.expected = sorted(expected, key=os.fsencode)
        s.missing = [n for n in s.expected if n not in set(present)]
    if released:
        for m in matches:
            k = int(m.group(1))
            if 1 <= k <= RELEASED_SHARDS:
                have = os.path.getsize(os.path.join(model_dir, m.group(0)))
                want = released_shard_bytes(k)
                if have != want:
                    s.wrong_size.append((m.group(0), have, want))
    return s


# --- sections -----------------------------------------------------------------------

@dataclass
class State:
    """What the sections learn, for the later ones and the verdict."""
    engine_ok: bool = False
    available: int = 0
    total: int = 0
    probe: object = None
    recommended: str | None = None
    cfg: object = None
    config_json: dict | None = None
    setup: object = None            # session.ModelSetup when the model indexed cleanly
    model_ok: bool = False
    model_problem: str = ""         # what to fix first, for the verdict
    model_fix: str = ""             # the next command for it
    manifest: object = None
    trunk_ok: bool = False
    trunk_problem: str = ""
    largest_shard: str | None = None    # the best cold devbw target
    tok_dir: str | None = None
    tok_ok: bool = False
    chat_ok: bool = False
    preset: str | None = None       # the run line's preset
    verify_failed: bool = False     # --verify found a bad layer or shard (exit 1)


def import_engine():
    """The compiled extension, then the runtime that drives it, imported by module name:
    a broken or missing build is seen even though the package itself imports (and a test
    can simulate it through sys.modules)."""
    K = importlib.import_module("k3engine.kernels")
    K.simd_active()
    importlib.import_module("k3engine.engine")
    return K


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def check_engine(r: Report, st: State) -> None:
    r.section("engine")
    r.info(f"k3engine {__version__} at {os.path.dirname(os.path.dirname(__file__))}")
    r.info(f"python {platform.python_version()} on {platform.system()} {platform.machine()}")
    if sys.version_info < (3, 11):
        r.warn("python is older than 3.11, which this project requires")
    try:
        K = import_engine()
    except Exception as e:  # noqa: BLE001 - any failure here means no engine
        r.fail(f"the engine's compiled extension (or the runtime over it) does not import "
               f"({type(e).__name__}: {e}): the engine cannot run")
        return
    st.engine_ok = True
    r.ok(f"compiled extension imports ({os.path.basename(K._kernels.__file__)})")
    flags = _cpu_flags()
    if K.simd_active():
        r.ok(f"{K.isa().upper()} kernels active (paths: {', '.join(K.isas_available())}; "
             f"K3_KERNEL_ISA forces one)")
    else:
        why = "this CPU has no AVX2" if flags and "avx2" not in flags else \
            "the SIMD paths are not active (K3_KERNEL_ISA=scalar, or this build)"
        r.warn(f"scalar kernels ({why}): the slow path, same bits")
    if flags:
        r.info(f"AVX-512: {'yes' if 'avx512f' in flags else 'no'} (information only)")
    if K.mxq_active():
        r.info("one- and two-token MXFP4 matvecs: integer byte products (AVX-512 VNNI) "
               "where exact; K3_MXFP4_INT=0 turns them off")
    elif K.mxq_supported():
        r.info("one- and two-token MXFP4 matvecs: the double path (the integer one is off: "
               "K3_MXFP4_INT=0 or K3_KERNEL_ISA below avx512)")
    if K.isa() == "avx512":
        r.info(f"prefill matvecs wider than {K.PANEL_WIDE_INPUTS:,} inputs: "
               + ("the 2 x 4 tiles (AMD: faster there than the panels)" if K.panel_wide_tiles()
                  else "the panels"))
    path = {"avx2": "AVX2", "avx512": "AVX-512"}.get(K.isa())
    if K.libm_replicas_active():
        r.info(f"SiTU and sigmoid: {path} copies of this libm's expf/tanhf (equal to it at load)")
    elif path:
        r.info(f"SiTU and sigmoid: libm calls (this libm, {' '.join(platform.libc_ver())}, "
               f"differs from the {path} copies of glibc 2.36's; same bits, slower)")
    from ..threads import default_threads, physical_cores
    logical, phys = os.cpu_count() or 1, physical_cores()
    r.ok(f"threads: {default_threads()} (cores: {logical} logical, {phys} physical"
         + ("; OMP_NUM_THREADS set" if os.environ.get("OMP_NUM_THREADS") else "") + ")")
    if importlib.util.find_spec("tiktoken") is None:
        r.warn("tiktoken is not installed: text prompts and chat are unavailable "
               "(--ids still works)")
    if importlib.util.find_spec("PySide6") is None:
        r.info("PySide6 is not installed: K3 Studio (the GUI) is unavailable; the CLI is not "
               "affected")


def check_memory(r: Report, st: State) -> None:
    r.section("memory")
    avail, probe = available_memory()
    st.available, st.probe, st.total = avail, probe, probe.total or 0
    if probe.total is not None or probe.host is not None:
        r.info(f"MemTotal {(probe.total or 0) // GiB} GB, MemAvailable "
               f"{(probe.host or 0) // GiB} GB")
    if probe.malformed:
        r.warn(f"the memory probe fails closed ({probe.detail}): the engine will refuse to "
               f"plan until this is fixed")
        return
    if not probe.known:
        r.warn("available memory is unknown on this system: the engine's two memory refusals "
               "are off and --preset auto cannot size itself")
        return
    r.ok(f"available to a run: {probe.how}")
    name, speed = recommend_preset(avail)
    st.recommended = name
    if name:
        p = PRESETS[name]
        r.ok(f"recommended preset: {name} (trunk {p.trunk_gb:g} GB / expert cache "
             f"{p.cache_gb:g} GB; {speed} s/token on the released checkpoint)")
    else:
        r.warn(FLOOR_WARNING)
    try:
        r.info(auto_budget(avail, st.total).line + " (--preset auto)")
    except BudgetError as e:
        r.info(f"--preset auto: {e}")


def check_model(r: Report, st: State, model_dir: str) -> None:
    r.section(f"model: {model_dir}")
    if not os.path.isdir(model_dir):
        q = shlex.quote(model_dir)
        st.model_problem = f"{model_dir} is not a directory"
        st.model_fix = (f"k3 download {q}  (the released checkpoint), or "
                        f"k3 make-checkpoint {q} --dims demo  (a small demo model)")
        r.warn(st.model_problem)
        return
    from ..config import ConfigError, load_config
    path = os.path.join(model_dir, "config.json")
    try:
        cfg = load_config(path)         # not session.read_config: that imports the kernels
    except ConfigError as e:
        st.model_problem = str(e)
        st.model_fix = "restore the model's own config.json (the engine never guesses one)"
        r.warn(f"config: {e}")
        cfg = None
    else:
        st.cfg = cfg
        r.ok(f"config.json: {cfg.n_layers} layers ({cfg.layer_map()}), hidden {cfg.hidden}, "
             f"vocab {cfg.vocab}, {cfg.n_experts} experts top-{cfg.topk}")
        try:
            st.config_json = loads_strict(read_regular_file(path, CONFIG_LIMIT, "config"), path)
        except (InputFileError, JSONFormatError):
            st.config_json = None       # load_config accepted it; only chat's ids use this

    ss = shard_set(model_dir)
    complete = True
    if not ss.present:
        st.model_problem = st.model_problem or f"no .safetensors files in {model_dir}"
        r.warn(f"no .safetensors files in {model_dir}")
        return
    st.largest_shard = max((os.path.join(model_dir, n) for n in ss.present),
                           key=os.path.getsize)
    if ss.index_problem:
        r.warn(ss.index_problem)
    if ss.missing:
        complete = False
        shown = ", ".join(os.path.join(model_dir, n) for n in ss.missing[:5]) + (
            f" and {len(ss.missing) - 5} more" if len(ss.missing) > 5 else "")
        r.warn(f"{len(ss.missing)} of {len(ss.expected)} shards missing: {shown} "
               f"(a partial download cannot run the model)")
        st.model_problem = st.model_problem or \
            f"missing shard {os.path.join(model_dir, ss.missing[0])}"
    for name, have, want in ss.wrong_size:
        complete = False
        r.warn(f"{os.path.join(model_dir, name)} is {have:,} bytes, the released shard is "
               f"{want:,}: truncated or damaged")
        st.model_problem = st.model_problem or f"wrong size: {name}"
    if ss.released and complete:
        r.ok(f"{RELEASED_SHARDS} shards, every size as published "
             f"({RELEASED_TOTAL:,} bytes in total)")
    elif complete:
        r.ok(f"{len(ss.present)} shard file(s)"
             + (", every one the index names" if ss.expected else ""))

    for name in TOKENIZER_FILES:
        if not os.path.exists(os.path.join(model_dir, name)):
            r.info(f"{name} is not in the model directory (pass --tok DIR for text)")
    if cfg is None or not st.engine_ok:
        if cfg is not None:
            r.info("tensor index not checked: it needs the engine")
        return

    from ..checkpoint import CheckpointError
    from ..loading import open_model
    t0 = time.monotonic()
    try:
        st.setup = open_model(model_dir, cfg)
    except CheckpointError as e:
        # A missing shard was already named above; the reader says the same thing.
        if not (e.path and os.path.basename(e.path) in ss.missing):
            r.warn(str(e))
        st.model_problem = st.model_problem or str(e)
        return
    ck, fig = st.setup.ck, st.setup.figures
    for note in ck.notes:
        r.info(note)
    on_disk = sum(os.path.getsize(p) for p in ck.shards)
    r.ok(f"{len(ck):,} tensors in {len(ck.shards)} shard(s), {human(on_disk)}, indexed in "
         f"{time.monotonic() - t0:.2f} s")
    r.ok(f"every tensor of all {cfg.n_layers} layers present, with {fig.expert_pool:,} routed "
         f"experts of {fig.expert_bytes:,} B")
    st.model_ok = complete and not st.model_problem


def check_trunk(r: Report, st: State, trunk_dir: str | None, model_dir: str | None) -> None:
    r.section("trunk" + (f": {trunk_dir}" if trunk_dir else ""))
    if not st.engine_ok:
        r.info("not checked: it needs the engine")
        return
    if not trunk_dir:
        if st.setup is not None:
            size = sum(st.setup.figures.layer_sizes)
            r.warn(f"no --trunk: every preset streams a packed trunk; without one the whole "
                   f"trunk ({human(size)}) is resident")
            where = os.path.dirname(os.path.abspath(suggested_trunk(model_dir)))
            free = devbw.free_bytes(where)
            if free is not None and free < size:
                r.warn(f"packing needs {human(size)} but {where} has {human(free)} free")
        else:
            r.info("no --trunk given")
        st.trunk_problem = "none"
        return
    from ..trunk import TrunkError, TrunkManifest, TrunkMismatchError
    try:
        m = TrunkManifest.load(trunk_dir)
    except TrunkError as e:
        st.trunk_problem = "damaged"
        r.warn(str(e))
        return
    if m.draft is not None:             # the engine refuses it as --trunk: say so here
        st.trunk_problem = "draft"
        r.warn(f"{trunk_dir} is a {m.draft.get('bits')}-bit draft trunk (for --draft-trunk); "
               f"--trunk needs the exact packed trunk")
        return
    st.manifest = m
    r.ok(f"trunk.json: {len(m.layers)} layers, {human(m.total_bytes())} in trunk.bin, largest "
         f"run {human(max((x.nbytes for x in m.layers), default=0))} (the streaming slot)")
    if st.setup is None:
        r.info("not matched against a model (no usable --model)")
        return
    try:
        m.check_against(st.setup.ck, st.setup.n_layers)
    except TrunkMismatchError as e:
        st.trunk_problem = "other model"
        r.warn(f"{e}: it was packed from another model or revision")
        return
    except TrunkError as e:
        st.trunk_problem = "damaged"
        r.warn(str(e))
        return
    st.trunk_ok = True
    r.ok(f"belongs to {model_dir}: every layer's tensors match the checkpoint")


def check_tokenizer(r: Report, st: State, tok_dir: str | None, model_dir: str | None) -> None:
    if tok_dir is None and model_dir and all(
            os.path.exists(os.path.join(model_dir, n)) for n in TOKENIZER_FILES):
        tok_dir = model_dir             # generated and released model dirs carry them
    r.section("tokenizer" + (f": {tok_dir}" if tok_dir else ""))
    if tok_dir is None:
        if model_dir and os.path.isdir(model_dir):
            r.warn("no tokenizer: text prompts and chat need --tok DIR (tiktoken.model + "
                   "tokenizer_config.json); --ids works without one")
        else:
            r.info("no --tok given")
        return
    missing = [n for n in TOKENIZER_FILES if not os.path.exists(os.path.join(tok_dir, n))]
    if missing:
        r.warn(f"{tok_dir}: missing {', '.join(missing)}")
        return
    if importlib.util.find_spec("tiktoken") is None:
        r.info("not loaded: tiktoken is not installed")
        return
    from ..tokenizer import Tokenizer, TokenizerError, control_ids
    try:
        tok = Tokenizer.from_dir(tok_dir)
    except (TokenizerError, OSError) as e:
        r.warn(f"tokenizer files do not load: {e}")
        return
    st.tok_dir = tok_dir
    r.ok(tok.report_line())
    st.tok_ok = True
    if st.cfg is not None and tok.vocab_size > st.cfg.vocab:
        st.tok_ok = False
        r.warn(f"the tokenizer's ids reach {tok.vocab_size - 1} but the model's vocabulary is "
               f"{st.cfg.vocab}: this tokenizer belongs to another model")
        return
    try:
        ids = control_ids(tok, st.config_json)
    except TokenizerError as e:
        r.warn(f"chat unavailable: {e}")
        return
    st.chat_ok = True
    r.ok(f"control tokens found: end of turn {ids.end_of_msg}, [EOS] {ids.eos}, "
         f"[BOS] {ids.bos}")


def check_storage(r: Report, st: State, directory: str, probe_mb: int,
                  model_given: bool) -> None:
    r.section(f"storage: {directory}")
    free = devbw.free_bytes(directory)
    if free is not None:
        if not model_given and free < FREE_FOR_DOWNLOAD:
            r.warn(f"{human(free)} free; the released checkpoint and its trunk need about "
                   f"{human(FREE_FOR_DOWNLOAD)}")
        else:
            r.ok(f"{human(free)} free")
    if probe_mb <= 0:
        r.info("read test skipped (--probe-mb 0)")
        return
    size = probe_mb * 10**6
    block = min(devbw.EXPERT_BYTES, size // 4 // ALIGN * ALIGN)
    kw = dict(block=block, depths=PROBE_DEPTHS, reads=devbw.READS, seconds=PROBE_SECONDS)
    try:
        res = devbw.measure_dir(directory, size, **kw)
    except devbw.DevbwError as e:
        r.warn(f"read test not run: {e}")
        return
    q = {x.qd: x for x in res.results}
    figures = ", ".join(f"QD{d} {q[d].mbs:,.0f} MB/s" for d in PROBE_DEPTHS)
    what = (f"random {human(block)} reads of a {human(size)} scratch file "
            f"({q[PROBE_DEPTHS[0]].reads + q[PROBE_DEPTHS[-1]].reads} reads)")
    if res.direct:
        r.ok(f"O_DIRECT {what}: {figures}")
    else:
        r.warn(f"this filesystem refuses O_DIRECT, so the engine reads it buffered; "
               f"buffered {what}: {figures} (the page cache may inflate these)")
    r.info(PER_TOKEN_NOTE)
    target = shlex.quote(st.largest_shard) if st.largest_shard else \
        shlex.quote(os.path.join(directory, "<a large file>"))
    r.info(f"a scratch file just written may be cached; for cold figures: k3 devbw {target}")


def check_plan(r: Report, st: State) -> None:
    """The run line's preset: the recommended one, or a smaller one if this machine does
    not admit it for this model.  Uses the engine's own planner and admission rule."""
    from ..memory import plan
    fig = st.setup.figures
    if st.trunk_ok:
        fig = dataclasses.replace(fig, layer_sizes=tuple(
            x.nbytes for x in st.manifest.layers[:st.setup.n_layers]))
    # Without a usable trunk the layer sizes are the checkpoint's runs, which is what
    # pack-trunk will write (to within page rounding): the run line always streams.
    start = PRESET_ORDER.index(st.recommended or "laptop")
    r.section("plan")
    last = None
    for name in PRESET_ORDER[start:]:
        p = plan(fig, preset=name, streamed=True, positions=PLAN_POSITIONS,
                 available_bytes=st.probe, total_memory=st.total)
        last = (name, p)
        if p.admitted:
            st.preset = name
            r.ok(f"--preset {name} plans {human(p.total_bytes)} for this model with a streamed "
                 f"trunk; {human(st.available)} available: admitted")
            return
    name, p = last
    r.warn(f"no preset is admitted for this model on this machine; --preset {name}: "
           + p.refusals[0].message.strip().splitlines()[0])


# --- the verdict and the next command -----------------------------------------------

def suggested_trunk(model_dir: str | None) -> str:
    base = os.path.normpath(model_dir or "model")
    return base + "-trunk"


def run_line(model_dir: str, trunk_dir: str, st: State) -> list[str]:
    q = shlex.quote
    head = f"k3 {q(model_dir)} --trunk {q(trunk_dir)}"
    preset = f" --preset {st.preset or 'laptop'}"
    if st.tok_ok:
        lines = [f"{head} --tok {q(st.tok_dir)}{preset} --prompt 'Hello'"]
        if st.chat_ok:
            lines.append(f"{head} --tok {q(st.tok_dir)}{preset} --chat")
        return lines
    return [f"{head}{preset} --ids 1,2,3"]


def verdict(r: Report, st: State, a) -> None:
    r.section("result")
    if not st.engine_ok:
        r.plain("  the engine cannot run on this install: its compiled extension does not "
                "import.")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))))
        if os.path.exists(os.path.join(root, "pyproject.toml")):
            cmd = f"python -m pip install -e {shlex.quote(root)}"
        else:
            cmd = "python -m pip install --force-reinstall k3studio"
        r.plain(f"  next (rebuilds the extension; needs a C compiler): {cmd}")
        return
    if st.verify_failed:
        r.plain("  --verify found damaged data (named above): re-pack a damaged trunk with "
                "k3 pack-trunk, fetch a damaged shard again with k3 download.")
        return
    if st.recommended:
        r.plain(f"  this machine can run Kimi K3 (the released checkpoint) with --preset "
                f"{st.recommended}.")
    else:
        r.plain("  this machine runs the engine and small models, but has less memory than "
                "the released checkpoint needs.")
    if not a.model:
        r.plain("  next: check a model with  k3 doctor --model DIR  or make the demo model:")
        r.plain("    k3 make-checkpoint k3-demo --dims demo")
        return
    if not st.model_ok:
        r.plain(f"  the model at {a.model} cannot run yet: {st.model_problem or 'see above'}.")
        fix = st.model_fix or ("restore the files named above (k3 download resumes a "
                                "partial download), then run k3 doctor again")
        r.plain(f"  next: {fix}")
        return
    cmds = []
    trunk = a.trunk
    if not st.trunk_ok:
        # pack-trunk refuses a directory holding another model's trunk: use a fresh one
        fresh = suggested_trunk(a.model)
        if trunk and os.path.abspath(trunk) == os.path.abspath(fresh):
            fresh += "-2"
        trunk = fresh
        why = {"none": "no packed trunk yet", "other model": "the trunk given is another "
               "model's", "damaged": "the trunk given is damaged",
               "draft": "the trunk given is a draft trunk"}.get(st.trunk_problem, "")
        r.plain(f"  the model at {a.model} is ready; {why}.")
        cmds.append(f"k3 pack-trunk {shlex.quote(a.model)} {shlex.quote(trunk)}")
    else:
        r.plain(f"  the model at {a.model} and its trunk are ready.")
    cmds += run_line(a.model, trunk, st)
    r.plain("  next:")
    for c in cmds:
        r.plain(f"    {c}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="k3 doctor", description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 checked (warnings are listed, not fatal), 1 the engine cannot "
               "run (its compiled extension does not import), or --verify found a layer or "
               "shard that does not match its recorded digest.")
    ap.add_argument("--model", metavar="DIR", help="checkpoint directory to check")
    ap.add_argument("--trunk", metavar="DIR", help="packed trunk (k3 pack-trunk) to check")
    ap.add_argument("--tok", metavar="DIR",
                    help="tokenizer directory (default: the model directory if it has one)")
    ap.add_argument("--scratch", metavar="DIR",
                    help="where to write the read-test file (default: the model directory, "
                         "else the current one)")
    ap.add_argument("--verify", action="store_true",
                    help="re-read every byte: the trunk's layers against the SHA-256 digests "
                         "pack-trunk recorded, the checkpoint's shards against the digests "
                         "recorded by k3 download or make-checkpoint; names any bad layer or "
                         "shard and exits 1 (slow: not part of a normal check)")
    ap.add_argument("--probe-mb", type=int, default=PROBE_MB, metavar="N",
                    help="size of the read-test file in MB; 0 skips the test "
                         "(default %(default)s)")
    ap.add_argument("--datapoint", nargs="?", const="k3-datapoint", metavar="PATH",
                    help="run --model once and write a shareable PATH.json + PATH.md record")
    a = ap.parse_args(argv)
    if a.probe_mb < 0:
        ap.error("--probe-mb must be 0 or more")
    if a.datapoint is not None:
        from .datapoint import doctor_hook
        return doctor_hook(a.datapoint, a.model, a.trunk)

    r, st = Report(), State()
    r.plain(f"k3 doctor ({platform.system()} {platform.release()})")
    sections = [
        ("engine", lambda: check_engine(r, st)),
        ("memory", lambda: check_memory(r, st)),
        ("model", lambda: a.model and check_model(r, st, a.model)),
        ("trunk", lambda: (a.model or a.trunk) and check_trunk(r, st, a.trunk, a.model)),
        ("tokenizer", lambda: (a.model or a.tok) and check_tokenizer(r, st, a.tok, a.model)),
        ("plan", lambda: st.engine_ok and st.model_ok and check_plan(r, st)),
        ("storage", lambda: check_storage(r, st, _scratch_dir(a), a.probe_mb, bool(a.model))),
        ("leftovers", lambda: check_leftovers(r, [a.model, a.trunk])),
    ]
    if a.verify:
        sections.append(("verify", lambda: check_verify(r, st, a)))
    try:
        for name, run in sections:
            try:
                run()
            except Exception as e:  # noqa: BLE001 - a doctor that crashes reports nothing
                r.warn(f"the {name} check itself failed ({type(e).__name__}: {e})")
    except KeyboardInterrupt:           # the read test has already removed its file
        print("k3 doctor: interrupted", file=sys.stderr)
        return 130
    finally:
        if st.setup is not None:
            st.setup.ck.close()
    verdict(r, st, a)
    n = len(r.warnings)
    r.plain(f"\n{n} warning{'s' if n != 1 else ''}"
            + (f", {len(r.failures)} failure(s)" if r.failures else ""))
    if a.verify and st.verify_failed:
        return 1
    return 0 if st.engine_ok else 1


def check_leftovers(r: Report, dirs: list[str | None]) -> None:
    """Temp and partial files of ours that a killed save, pack or download left behind."""
    from ..integrity import stale_files
    found = [f for d in dirs if d and os.path.isdir(d) for f in stale_files(d)]
    if not found:
        return
    r.section("leftovers")
    for path, size in found:
        what = ("a partial download (k3 download resumes it)" if path.endswith(".incomplete")
                else "left by an interrupted save or pack (safe to delete when no k3 runs)")
        r.warn(f"{path}: {human(size)}, {what}")


def check_verify(r: Report, st: State, a) -> None:
    """--verify: every byte against its recorded digest, with progress, naming what is bad."""
    from ..integrity import verify_shards, verify_trunk
    if not (a.trunk or a.model):
        r.section("verify")
        r.warn("--verify needs --trunk DIR and/or --model DIR")
        st.verify_failed = True
        return
    if a.trunk:
        r.section(f"verify trunk: {a.trunk}")
        for p in verify_trunk(a.trunk, r.plain):
            r.fail(p)
            st.verify_failed = True
    if a.model:
        r.section(f"verify shards: {a.model}")
        problems, what = verify_shards(a.model, r.plain)
        for p in problems:
            r.fail(p)
            st.verify_failed = True
        if not problems:
            (r.ok if "not verified" not in what else r.warn)(what)


def _scratch_dir(a) -> str:
    if a.scratch:
        return a.scratch
    if a.model and os.path.isdir(a.model) and os.access(a.model, os.W_OK):
        return a.model
    return os.getcwd()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

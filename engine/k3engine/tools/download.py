"""`k3 download DEST`: fetch the Kimi K3 checkpoint from a Hugging Face hub, resumably, and
prove it complete (SYSTEM §1.1, §1.9, §10.5).

What it does, in order:

1. Resolves the revision (`--revision`, else `K3_REVISION`, else `main`) to one 40-hex commit
   with one metadata call (`HfApi.model_info(..., files_metadata=True)`), and uses that commit
   for every file it fetches and every figure it checks.
2. Sets the expected figures: each file's size, the hub's LFS SHA-256 (or the git blob id of a
   small non-LFS file), and the shard count.  For the real checkpoint (`REAL_REPO_ID`) the
   shard names, count and sizes are the published table below, which the server's listing
   must agree with before anything is fetched, so a lying server cannot pass.
3. `--layers N` fetches `model.safetensors.index.json` first and keeps only the shards that
   hold tensors of layers 0..N-1 plus the model-level tensors (embedding, final norms,
   lm_head); every small non-shard file (config, tokenizer, index) is always fetched.
4. Refuses to start (exit 1) unless the file system of DEST has the bytes still to fetch.
5. Fetches each file over HTTP with Range requests into `DEST/.k3-download/`, resuming a
   partial file left by an earlier run or by a dropped connection, then moves it into place.
   (huggingface_hub 1.x+ deletes its own partial file when a download fails, so the byte
   transfer is done here; metadata, URLs, auth headers and the HTTP session are the
   library's.)
6. Verifies: shard count, total bytes, every file's size, then the SHA-256 of every LFS file
   (streamed, with the rate reported) and the git blob id of every small file; the manifest of
   expected figures is kept in `DEST/.k3-download/manifest.json` so `--verify-only` also works
   when the hub cannot be reached.  Any mismatch names the file with the expected and actual
   figure and exits 1; exit 0 only when everything verifies.

The token comes from `HF_TOKEN` (else the library's stored login); it is never printed: every
line this tool writes passes through a filter that masks it.  The hub endpoint is `--endpoint`,
else `HF_ENDPOINT`, else the library's default.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import stat
import sys
import time
import unicodedata
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable
from urllib.parse import urlparse

from ..atomic import open_dir, open_nofollow, write_atomic
from ..checkpoint import INDEX_JSON, INDEX_LIMIT
from ..inputfile import InputFileError, MiB, read_regular_file
from ..strict_json import JSONFormatError, loads_strict
from ..memory import human

# --- the real checkpoint -------------------------------------------------------------------

# The public hub id of the released checkpoint.  The spec does not state it; this is the id
# the released model is published under and that every public `hf download` of it uses.
REAL_REPO_ID = "moonshotai/Kimi-K3"
REAL_SHARD_COUNT = 96
REAL_TOTAL_BYTES = 1_560_936_091_448


def _published_shard_sizes() -> dict[str, int]:
    """SYSTEM §1.1's table of per-shard sizes (from the reference's scripts/shard_sizes.txt),
    expanded to one entry per shard name.  Checked against the published total at import."""
    sizes: dict[int, int] = {1: 2_341_216_112, 94: 4_697_664_072, 95: 92_289_328,
                             96: 802_448_352}
    for k in (2, 3, 5, 6, 7, 9, 10):
        sizes[k] = 16_990_911_504
    for k in (4, 8):
        sizes[k] = 16_567_501_776
    for k in [*range(12, 93, 4), 93]:
        sizes[k] = 16_567_507_176
    for k in range(11, 92):
        sizes.setdefault(k, 16_990_916_912)
    return {shard_name(k, REAL_SHARD_COUNT, 6): sizes[k] for k in range(1, REAL_SHARD_COUNT + 1)}


def shard_name(k: int, n: int, of_digits: int = 5) -> str:
    """`model-000NN-of-000096.safetensors` (the real checkpoint pads the count to 6 digits)."""
    return f"model-{k:05d}-of-{n:0{of_digits}d}.safetensors"


PUBLISHED_SHARD_SIZES: dict[str, int] = _published_shard_sizes()
assert len(PUBLISHED_SHARD_SIZES) == REAL_SHARD_COUNT
assert sum(PUBLISHED_SHARD_SIZES.values()) == REAL_TOTAL_BYTES

# --- files and knobs -----------------------------------------------------------------------

SHARD_RE = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")
PART_DIR = ".k3-download"           # partial files and the manifest, inside DEST
MANIFEST = "manifest.json"
MANIFEST_LIMIT = 64 * MiB
HASH_CHUNK = 8 << 20                # streamed hashing, 8 MiB reads
WRITE_BUFFER = 1 << 20              # file buffer for the HTTP body (chunks are taken as they
                                    # arrive: a re-chunking buffer would lose its bytes on a drop)
MAX_ATTEMPTS = 8                    # per file, on dropped connections / 5xx / 429
RETRY_SLEEP_MAX = 30.0              # seconds; backoff is 1, 2, 4, ... up to this
PROGRESS_EVERY = 10.0               # seconds between progress lines of one file
HTTP_TIMEOUT = 60.0                 # seconds without data before a read counts as dropped
TEXT_PREFIX = "language_model."     # the text tower; vision_tower.* / mm_projector.* are unused
LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")

from ..errors import EXIT_OK, EXIT_USAGE, EXIT_RUNTIME as EXIT_FAIL  # noqa: E402


class DownloadError(Exception):
    """A failure to report in one line (already names the file and the figures)."""


@dataclass
class FileFigure:
    name: str
    size: int
    sha256: str | None = None        # hub's LFS sha256 (content hash)
    git_oid: str | None = None       # git blob sha1, for small non-LFS files


@dataclass
class Expected:
    repo: str
    commit: str
    files: dict[str, FileFigure]
    shard_count: int
    source: str                      # where the figures came from, for the report
    published: bool = False          # sizes pinned by the shipped table
    endpoint: str | None = None      # the hub a saved manifest was fetched from

    def shards(self) -> list[str]:
        return sort_shards(n for n in self.files if SHARD_RE.match(n))


def sort_shards(names: Iterable[str]) -> list[str]:
    return sorted(names, key=lambda n: int(SHARD_RE.match(n).group(1)))


# --- output, with the token masked ---------------------------------------------------------

class Out:
    def __init__(self, secrets: Iterable[str | None] = ()):
        self.secrets = [s for s in secrets if s]

    def mask(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "***")
        return text

    def say(self, msg: str = "") -> None:
        print(self.mask(msg), flush=True)

    def err(self, msg: str) -> None:
        print(self.mask(msg), file=sys.stderr, flush=True)

    def progress(self, name: str, have: int, size: int) -> None:
        """After every chunk written (the app's progress bars); an exception raised here
        stops the download with the partial file kept, so the next run resumes it."""


def _rate(nbytes: int, secs: float) -> str:
    return f"{nbytes / 1e6 / max(secs, 1e-9):,.1f} MB/s"


# --- expected figures ----------------------------------------------------------------------

# --- names the hub gives: where a file may be written ------------------------------------
#
# Silent-failure trap (issue 14, finding 1): the hub's listing decides file names, and
# DEST / name with name "../../x", "/etc/x" or a path through a symlink writes outside DEST
# (and the run still ended "verified").  Every name is checked here, before any byte is
# written: plain relative components only, none of them a link, no two names for one file.

_NAME_PART = re.compile(r"[^\x00-\x1f\x7f\\:]+")   # no control bytes, backslash or colon
MAX_NAME_BYTES = 1024


def check_name(name: object) -> str:
    """`name` if it is a plain relative path (components joined by '/'), else DownloadError."""
    if not isinstance(name, str) or not name:
        raise DownloadError(f"the hub lists a file with no usable name ({name!r})")
    shown = repr(name[:120])
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise DownloadError(f"the hub lists a file name of more than {MAX_NAME_BYTES} bytes")
    if name.startswith("/") or os.path.isabs(name):
        raise DownloadError(f"the hub lists {shown}: an absolute path; refusing to write "
                            "outside the destination")
    parts = name.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise DownloadError(f"the hub lists {shown}: not a plain relative name "
                                f"({'empty' if not part else repr(part)} component); refusing "
                                "to write outside the destination")
        if not _NAME_PART.fullmatch(part):
            raise DownloadError(f"the hub lists {shown}: a control character, backslash or "
                                "colon in the name")
        try:
            part.encode("utf-8")
        except UnicodeEncodeError:
            raise DownloadError(f"the hub lists {shown}: not valid Unicode") from None
    if parts[0] == PART_DIR:
        raise DownloadError(f"the hub lists {shown}, inside this tool's own {PART_DIR}/")
    return name


def _fold(name: str) -> str:
    # Two names one file system may take for one file (case-insensitive or normalising
    # file systems: macOS, Windows) are a collision on every system.
    return unicodedata.normalize("NFC", name).casefold()


def check_names(names: Iterable[str]) -> None:
    """Every name plain, no two of them one file, none a directory of another."""
    seen: dict[str, str] = {}
    names = [check_name(n) for n in names]
    for n in names:
        k = _fold(n)
        if k in seen:
            raise DownloadError(f"the hub lists {seen[k]!r} and {n!r}, which name the same "
                                "file on a case-insensitive or normalising file system")
        seen[k] = n
    for n in names:
        parts = _fold(n).split("/")
        for i in range(1, len(parts)):
            d = "/".join(parts[:i])
            if d in seen:
                raise DownloadError(f"the hub lists {seen[d]!r} as a file and {n!r} inside it")


def safe_target(dest: Path, name: str) -> Path:
    """DEST / name, refused if any component under DEST exists as a symlink (or the final
    one as anything but a regular file): writing through it would land outside DEST."""
    path = dest
    parts = name.split("/")
    for i, part in enumerate(parts):
        path = path / part
        last = i == len(parts) - 1
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            break
        except OSError as e:
            raise DownloadError(f"{path}: cannot check the target ({e.strerror})") from None
        if stat.S_ISLNK(st.st_mode):
            raise DownloadError(f"{path} is a symbolic link; refusing to write {name} through "
                                "it (it could point outside the destination)")
        if last and not stat.S_ISREG(st.st_mode):
            raise DownloadError(f"{path} exists and is not a regular file; refusing to "
                                f"replace it with {name}")
        if not last and not stat.S_ISDIR(st.st_mode):
            raise DownloadError(f"{path} exists and is not a directory, but {name} needs it "
                                "as one")
    return dest / name


def check_targets(dest: Path, files: Iterable[FileFigure]) -> None:
    """The destination's own checks, before anything is written: DEST/.k3-download, the
    manifest and every partial file in it must not be links either (issue 47: a link
    planted at manifest.json or at NAME.<sha16>.incomplete received the bytes).  The opens
    themselves refuse links too (O_NOFOLLOW); this says so before the first byte."""
    part_dir = dest / PART_DIR
    if part_dir.is_symlink():
        raise DownloadError(f"{part_dir} is a symbolic link; refusing to write partial "
                            "files through it")
    safe_target(part_dir, MANIFEST)
    for fig in files:
        safe_target(dest, fig.name)
        safe_target(part_dir, part_path(dest, fig).relative_to(part_dir).as_posix())


def expected_from_siblings(repo: str, commit: str, siblings: list[dict]) -> Expected:
    """Expected figures from the hub's file listing; for the real checkpoint the listing must
    match the published table (names, count, every size) or this raises naming the file."""
    files: dict[str, FileFigure] = {}
    check_names(s.get("name") for s in siblings)
    for s in siblings:
        name = s["name"]
        size = s.get("size")
        if size is None:
            raise DownloadError(f"the hub's listing gives no size for {name}")
        if type(size) is not int or not 0 <= size < 1 << 50:
            raise DownloadError(f"the hub's listing gives {name} the size {size!r}")
        for key in ("sha256", "git_oid"):
            v = s.get(key)
            if v is not None and not (isinstance(v, str) and re.fullmatch(r"[0-9a-fA-F]{40,64}", v)):
                raise DownloadError(f"the hub's listing gives {name} the {key} {str(v)[:80]!r}")
        files[name] = FileFigure(name, size, s.get("sha256"), s.get("git_oid"))
    shards = sort_shards(n for n in files if SHARD_RE.match(n))
    if repo == REAL_REPO_ID:
        problems = []
        for name, size in PUBLISHED_SHARD_SIZES.items():
            if name not in files:
                problems.append(f"{name} is missing from the hub's listing")
            elif files[name].size != size:
                problems.append(f"{name}: the hub lists {files[name].size:,} bytes, "
                                f"the published size is {size:,}")
        problems += [f"{n} is not one of the {REAL_SHARD_COUNT} published shards"
                     for n in shards if n not in PUBLISHED_SHARD_SIZES]
        if problems:
            raise DownloadError("the hub's listing disagrees with the published shard table "
                                f"(SYSTEM §1.1) for {repo}@{commit[:12]}:\n  "
                                + "\n  ".join(problems))
        return Expected(repo, commit, files, REAL_SHARD_COUNT,
                        "published shard table + hub metadata", published=True)
    if not shards:
        raise DownloadError(f"{repo}@{commit[:12]} lists no model-NNNNN-of-NNNNN.safetensors "
                            "shards")
    counts = {int(SHARD_RE.match(n).group(2)) for n in shards}
    numbers = [int(SHARD_RE.match(n).group(1)) for n in shards]
    if len(counts) != 1 or sorted(numbers) != list(range(1, len(shards) + 1)) \
            or counts != {len(shards)}:
        more = " ..." if len(shards) > 4 else ""
        raise DownloadError(f"the hub lists {len(shards)} shards whose names do not number "
                            f"1..N of N: {', '.join(shards[:4])}{more}")
    return Expected(repo, commit, files, len(shards), "hub metadata")


def fetch_expected(hub: "Hub") -> Expected:
    info = hub.api.model_info(hub.repo, revision=hub.revision, files_metadata=True)
    commit = info.sha
    if not commit or not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise DownloadError(f"the hub did not resolve {hub.repo}@{hub.revision} to a commit")
    siblings = []
    for s in info.siblings or []:
        lfs = s.lfs
        siblings.append({"name": s.rfilename,
                         "size": lfs.size if lfs is not None else s.size,
                         "sha256": lfs.sha256 if lfs is not None else None,
                         "git_oid": s.blob_id if lfs is None else None})
    hub.commit = commit
    return expected_from_siblings(hub.repo, commit, siblings)


def save_manifest(dest: Path, exp: Expected, endpoint: str) -> None:
    d = dest / PART_DIR
    d.mkdir(parents=True, exist_ok=True)
    doc = {"repo": exp.repo, "commit": exp.commit, "endpoint": endpoint,
           "files": [asdict(f) for f in exp.files.values()]}
    write_atomic(d / MANIFEST, (json.dumps(doc, indent=1) + "\n").encode(), mode=0o644,
                 inside=dest)


def load_manifest(dest: Path, repo: str | None) -> Expected | None:
    """The expected figures saved in DEST before the first byte was fetched; None when DEST
    has no (readable) manifest or it is another repository's.  `repo` None: whichever
    repository the manifest names."""
    path = dest / PART_DIR / MANIFEST
    try:
        doc = loads_strict(read_regular_file(path, MANIFEST_LIMIT, "manifest"), str(path))
    except (InputFileError, JSONFormatError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("repo"), str) \
            or doc["repo"] != (repo or doc["repo"]):
        return None
    repo = doc["repo"]
    try:
        siblings = [{"name": f["name"], "size": f["size"], "sha256": f.get("sha256"),
                     "git_oid": f.get("git_oid")} for f in doc["files"]]
        commit = doc["commit"]
    except (KeyError, TypeError, AttributeError):
        raise DownloadError(f"{path}: the saved manifest is damaged") from None
    exp = expected_from_siblings(repo, str(commit), siblings)
    exp.source += " (saved manifest; hub not reachable)"
    endpoint = doc.get("endpoint")
    exp.endpoint = endpoint if isinstance(endpoint, str) else None
    return exp


@dataclass(frozen=True)
class DownloadState:
    """How far a download this tool started in DEST has got, from its saved manifest and
    the files on disk (sizes only: no hashing, cheap enough for a live check)."""
    repo: str
    endpoint: str | None
    shards: int                      # shards of the checkpoint
    shards_done: int                 # present with the expected size
    shards_started: int              # part-way: a partial file in DEST/.k3-download
    files_left: int                  # any file (shard or small) not yet in place
    bytes_done: int                  # of every file, partial files included
    bytes_total: int

    @property
    def complete(self) -> bool:
        return self.files_left == 0

    def line(self) -> str:
        """`partial download: 3 of 14 shards, 1 part-way; 1.2 MB of 4.1 MB`."""
        part = f", {self.shards_started} part-way" if self.shards_started else ""
        return (f"partial download: {self.shards_done} of {self.shards} shards{part}; "
                f"{human(self.bytes_done)} of {human(self.bytes_total)}")


def download_state(dest) -> DownloadState | None:
    """DEST's download state, or None when DEST holds no manifest of this tool (a folder
    filled some other way, or a damaged manifest: the caller's other checks speak then).
    The trap it avoids: an unfinished download met by the engine's reader is refused as a
    missing shard, which reads as a damaged checkpoint rather than "resume it"
    (tests/app/test_app_download.py checks the Setup tab's words)."""
    dest = Path(dest)
    try:
        exp = load_manifest(dest, None)
    except DownloadError:
        return None
    if exp is None:
        return None
    shards = set(exp.shards())
    done = started = left = have = 0
    for name, fig in exp.files.items():
        if _complete(dest / name, fig):
            have += fig.size
            done += name in shards
            continue
        left += 1
        part = part_path(dest, fig)
        try:
            got = _part_size(part)
        except OSError:
            got = 0
        if got:
            have += min(got, fig.size)
            started += name in shards
    return DownloadState(exp.repo, exp.endpoint, len(shards), done, started, left, have,
                         sum(f.size for f in exp.files.values()))


# --- which shards a layer prefix needs -----------------------------------------------------

def shards_for_layers(weight_map: dict[str, str], n_layers: int) -> tuple[set[str], int]:
    """The shards holding tensors of layers 0..n_layers-1 and the text tower's model-level
    tensors (embedding, final norms, lm_head).  Returns (shards, layers in the checkpoint).
    Only the text tower counts when the names have one (vision tensors are unused)."""
    names = list(weight_map)
    if any(n.startswith(TEXT_PREFIX) for n in names):
        names = [n for n in names if n.startswith(TEXT_PREFIX)]
    need: set[str] = set()
    total = 0
    for n in names:
        m = LAYER_RE.search(n)
        if m:
            L = int(m.group(1))
            total = max(total, L + 1)
            if L < n_layers:
                need.add(weight_map[n])
        else:
            need.add(weight_map[n])
    return need, total


# --- the hub -------------------------------------------------------------------------------

class Hub:
    """huggingface_hub, imported lazily and pointed at one endpoint."""

    def __init__(self, repo: str, revision: str, endpoint: str | None, token: str | None):
        os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
        try:
            import huggingface_hub
            from huggingface_hub import constants
        except ImportError as e:
            raise DownloadError("huggingface_hub is not installed "
                                "(pip install huggingface_hub)") from e
        # Telemetry (user-agent agent detection) would call constants.ENDPOINT, which is not
        # necessarily the endpoint asked for: this tool talks to one endpoint only.
        constants.HF_HUB_DISABLE_TELEMETRY = True
        if constants.is_offline_mode():
            raise DownloadError("HF_HUB_OFFLINE is set: unset it to download "
                                "(--verify-only works offline from the saved manifest)")
        import httpx2
        from huggingface_hub import utils as hf_utils
        self.hf = huggingface_hub
        self.utils = hf_utils
        self.httpx = httpx2
        self.repo, self.revision, self.token = repo, revision, token
        self.endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
        self.api = huggingface_hub.HfApi(endpoint=self.endpoint, token=token)
        self.commit: str | None = None

    def url(self, name: str) -> str:
        return self.hf.hf_hub_url(self.repo, name, revision=self.commit, endpoint=self.endpoint)

    def resolve(self, name: str):
        """HEAD /{repo}/resolve/{commit}/{name}: (download url, size, etag)."""
        url = self.url(name)
        meta = self.hf.get_hf_file_metadata(url, token=self.token, endpoint=self.endpoint,
                                            retry_on_errors=True)
        if meta.commit_hash and meta.commit_hash != self.commit:
            raise DownloadError(f"{name}: the hub answered for commit {meta.commit_hash[:12]}, "
                                f"not the resolved {self.commit[:12]}")
        return url, meta

    def headers(self, url: str, location: str) -> dict[str, str]:
        h = self.utils.build_hf_headers(token=self.token)
        hub_origins = {_origin(url), *(_origin(u) for u in HUB_URLS)}
        if _origin(location) not in hub_origins:
            h.pop("authorization", None)      # a signed CDN url: the token stays on the hub
        h["Accept-Encoding"] = "identity"
        return h


HUB_URLS = ("https://huggingface.co", "https://hf.co")   # where a mirror may redirect with auth


def _origin(url: str) -> tuple[str, str, int | None]:
    p = urlparse(url)
    port = p.port or {"http": 80, "https": 443}.get(p.scheme)
    return (p.scheme, (p.hostname or "").lower(), port)


# --- fetching one file ---------------------------------------------------------------------

def part_path(dest: Path, fig: FileFigure) -> Path:
    tag = re.sub(r"[^0-9A-Za-z]", "", fig.sha256 or fig.git_oid or "")[:16] or "nohash"
    return dest / PART_DIR / f"{fig.name}.{tag}.incomplete"


def fetch_file(hub: Hub, dest: Path, fig: FileFigure, out: Out, label: str) -> None:
    """Download one file to DEST/name, resuming DEST/.k3-download/name.<hash>.incomplete."""
    final = safe_target(dest, fig.name)
    part = part_path(dest, fig)
    for d in (part.parent, final.parent):      # made below DEST without following a link
        os.close(open_dir(d, inside=dest, create=True, mode=0o777))
    have = _part_size(part)
    if have > fig.size:
        part.unlink()
        have = 0
    if have:
        out.say(f"{label} {fig.name}: resuming at {human(have)} of {human(fig.size)}")
    else:
        out.say(f"{label} {fig.name}: fetching {human(fig.size)}")
    t0 = time.monotonic()
    start = have
    attempt = 0
    while have < fig.size or fig.size == 0:
        attempt += 1
        try:
            have = _fetch_range(hub, dest, fig, part, have, out)
            if have == fig.size:
                break
            raise hub.httpx.RemoteProtocolError(
                f"the body ended at {have:,} of {fig.size:,} bytes")
        except (hub.httpx.TransportError, _Retryable) as e:
            have = _part_size(part)
            if attempt >= MAX_ATTEMPTS:
                raise DownloadError(
                    f"{fig.name}: download interrupted at {have:,} of {fig.size:,} bytes after "
                    f"{attempt} attempts ({type(e).__name__}: {e}); the partial file is kept — "
                    "run the same command again to resume") from None
            out.say(f"{label} {fig.name}: connection lost at {human(have)} ({type(e).__name__}); "
                    f"resuming, attempt {attempt + 1} of {MAX_ATTEMPTS}")
            time.sleep(min(RETRY_SLEEP_MAX, 2.0 ** (attempt - 1)) if RETRY_SLEEP_MAX else 0)
    with _open_part(dest, part) as f:
        os.fsync(f.fileno())
    safe_target(dest, fig.name)        # again: a link may have appeared while fetching
    os.replace(part, final)
    secs = time.monotonic() - t0
    got = fig.size - start
    out.say(f"{label} {fig.name}: done, {human(got)} in {secs:.1f} s ({_rate(got, secs)})"
            + (f", resumed from {human(start)}" if start else "")
            + (f", resumed after {attempt - 1} dropped connection(s)" if attempt > 1 else ""))


class _Retryable(Exception):
    pass


def _part_size(part: Path) -> int:
    """Bytes in the partial file; a link at its name counts as none (never stat'ed through:
    the open refuses it)."""
    try:
        st = os.lstat(part)
    except FileNotFoundError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _open_part(dest: Path, part: Path):
    """The partial file, read-write, created 0666 less the umask like any download; a link
    at its name or in a folder below DEST is refused (OSError ELOOP), never followed."""
    return os.fdopen(open_nofollow(part, os.O_RDWR | os.O_CREAT, 0o666, inside=dest), "r+b",
                     buffering=WRITE_BUFFER)


def _fetch_range(hub: Hub, dest: Path, fig: FileFigure, part: Path, have: int,
                 out: Out) -> int:
    """One GET from `have` to the end, appended to `part`; returns the bytes now in it."""
    url, meta = hub.resolve(fig.name)
    if meta.size is not None and meta.size != fig.size:
        raise DownloadError(f"{fig.name}: the hub's resolve endpoint says {meta.size:,} bytes, "
                            f"the expected size is {fig.size:,}")
    location = meta.location or url
    headers = hub.headers(url, location)
    if have:
        headers["Range"] = f"bytes={have}-"
    session = hub.utils.get_session()
    with session.stream("GET", location, headers=headers,
                        timeout=hub.httpx.Timeout(HTTP_TIMEOUT, connect=30.0),
                        follow_redirects=True) as r:
        if r.status_code in (408, 429) or r.status_code >= 500:
            raise _Retryable(f"HTTP {r.status_code}")
        if r.status_code >= 400:
            r.read()
            hub.utils.hf_raise_for_status(r)
        if have and r.status_code == 206:
            m = re.match(r"bytes (\d+)-\d+/(\d+|\*)", r.headers.get("Content-Range", ""))
            total_ok = m is not None and (m.group(2) == "*" or int(m.group(2)) == fig.size)
            if not total_ok or int(m.group(1)) != have:
                raise DownloadError(f"{fig.name}: the server answered Range bytes={have}- with "
                                    f"Content-Range {r.headers.get('Content-Range')!r}")
        elif have:
            out.say(f"    {fig.name}: the server ignored the Range request; starting over")
            have = 0
        last = time.monotonic()
        t0, start = last, have
        with _open_part(dest, part) as f:
            f.seek(have)
            f.truncate()
            for chunk in r.iter_bytes():
                if not chunk:
                    continue
                if have + len(chunk) > fig.size:
                    raise DownloadError(f"{fig.name}: the server sent more than the expected "
                                        f"{fig.size:,} bytes")
                f.write(chunk)
                have += len(chunk)
                out.progress(fig.name, have, fig.size)
                now = time.monotonic()
                if now - last >= PROGRESS_EVERY:
                    last = now
                    out.say(f"    {fig.name}: {100.0 * have / fig.size:5.1f}%  {human(have)} of "
                            f"{human(fig.size)}, {_rate(have - start, now - t0)}")
    return have


# --- verification --------------------------------------------------------------------------

def git_blob_oid(path: Path) -> str:
    h = hashlib.sha1()
    h.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_file(path: Path, buf: bytearray) -> str:
    h = hashlib.sha256()
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


@dataclass
class VerifyResult:
    ok: bool
    bad: list[str] = field(default_factory=list)        # names, missing or wrong
    hashed_bytes: int = 0
    hash_seconds: float = 0.0


def verify(dest: Path, exp: Expected, names: list[str], checksum: bool, out: Out,
           partial_of: int | None = None) -> VerifyResult:
    """Check that `names` (all of exp.files, or a --layers subset) are in DEST with the expected
    size and hash, and that DEST holds no other shard.  Prints one line per file and a summary;
    returns whether everything verified."""
    res = VerifyResult(ok=True)
    problems: list[str] = []
    buf = bytearray(HASH_CHUNK)
    shards = sort_shards(n for n in names if SHARD_RE.match(n))
    out.say(f"verify: {len(names)} files in {dest} against {exp.source} "
            f"({exp.repo}@{exp.commit[:12]})")
    for name in sorted(names, key=lambda n: (bool(SHARD_RE.match(n)), n)):
        fig = exp.files[name]
        p = dest / name
        if not p.is_file():
            problems.append(f"{name}: missing")
            out.say(f"  MISSING {name}")
            res.bad.append(name)
            continue
        size = p.stat().st_size
        if size != fig.size:
            problems.append(f"{name}: {size:,} bytes, expected {fig.size:,}")
            out.say(f"  FAIL    {name}: size {size:,} bytes, expected {fig.size:,}")
            res.bad.append(name)
            continue
        what = "size"
        if checksum and (fig.sha256 or fig.git_oid):
            t0 = time.monotonic()
            if fig.sha256:
                got, want, kind = sha256_file(p, buf), fig.sha256.lower(), "sha256"
            else:
                got, want, kind = git_blob_oid(p), fig.git_oid.lower(), "git blob id"
            secs = time.monotonic() - t0
            res.hashed_bytes += size
            res.hash_seconds += secs
            if got != want:
                problems.append(f"{name}: {kind} {got}, expected {want}")
                out.say(f"  FAIL    {name}: {kind} {got}, expected {want}")
                res.bad.append(name)
                continue
            what = f"size, {kind}" + (f" at {_rate(size, secs)}" if fig.sha256 else "")
        out.say(f"  OK      {name}: {size:,} bytes ({what})")
    # no stray shard: the engine reads every *.safetensors in the directory
    present = sort_shards(n.name for n in dest.iterdir() if SHARD_RE.match(n.name)) \
        if dest.is_dir() else []
    for n in present:
        if n not in exp.files:
            problems.append(f"{n}: not a shard of {exp.repo}@{exp.commit[:12]} "
                            f"(expected {exp.shard_count} shards)")
            out.say(f"  FAIL    {n}: unexpected shard")
            res.bad.append(n)
    good = [n for n in shards if n not in res.bad]
    total = sum(exp.files[n].size for n in shards)
    got_total = sum((dest / n).stat().st_size for n in shards if (dest / n).is_file())
    if partial_of is None:
        out.say(f"shards: {len(good)} of {exp.shard_count} verified; "
                f"{got_total:,} of {total:,} bytes")
    else:
        out.say(f"shards: {len(good)} of the {len(shards)} shards layers 0..{partial_of - 1} "
                f"need verified ({exp.shard_count} in the checkpoint); "
                f"{got_total:,} of {total:,} bytes")
    if res.hashed_bytes:
        out.say(f"checksums: {human(res.hashed_bytes)} hashed at "
                f"{_rate(res.hashed_bytes, res.hash_seconds)}")
    elif not checksum:
        out.say("checksums: skipped (--skip-checksum / K3_SKIP_CHECKSUM=1): sizes only")
    if problems:
        res.ok = False
        for p in problems:
            out.err(f"k3 download: FAIL {p}")
        bad_shards = [n for n in res.bad if SHARD_RE.match(n)]
        n_expected = len(shards)
        if bad_shards:
            out.err(f"k3 download: {len(bad_shards)} of {n_expected} shards are missing or "
                    f"wrong in {dest}. A partial download cannot run the model.")
        out.err(f"k3 download: FAIL — delete the files named above and run "
                f"`k3 download {dest}` again (same options) to fetch them again.")
    return res


# --- main ----------------------------------------------------------------------------------

def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="k3 download",
        description="Download the Kimi K3 checkpoint from a Hugging Face hub (resumable) and "
                    "verify shard count, every file's size and the hub's SHA-256.",
        epilog="Environment: HF_TOKEN (access token; never printed), HF_ENDPOINT (hub URL), "
               "K3_REVISION (revision when --revision is absent), K3_SKIP_CHECKSUM=1 (as "
               "--skip-checksum).  Exit 0 only when everything verifies; 1 on any failure or "
               "refusal; 2 on a usage error.")
    ap.add_argument("dest", help="directory to download into (created if absent)")
    ap.add_argument("--repo", default=REAL_REPO_ID,
                    help="hub repository id (default %(default)s; its shard sizes are checked "
                         "against the published table)")
    ap.add_argument("--revision", default=None,
                    help="branch, tag or commit (default: K3_REVISION, else main); resolved "
                         "once to a commit used for every file")
    ap.add_argument("--endpoint", default=None,
                    help="hub URL (default: HF_ENDPOINT, else https://huggingface.co)")
    ap.add_argument("--layers", type=int, default=None, metavar="N",
                    help="fetch only the shards layers 0..N-1 and the model-level tensors need "
                         "(plus config and tokenizer files)")
    ap.add_argument("--verify-only", action="store_true",
                    help="download nothing; verify DEST against the hub's figures (or the "
                         "saved manifest when the hub cannot be reached)")
    ap.add_argument("--skip-checksum", action="store_true",
                    help="verify count and sizes only, not the SHA-256 (re-reads every byte)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.layers is not None and args.layers < 1:
        print("k3 download: --layers must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    token = os.environ.get("HF_TOKEN") or None
    out = Out([token])
    try:
        return _run(args, token, out)
    except KeyboardInterrupt:
        out.err("k3 download: interrupted; partial files are kept in "
                f"{Path(args.dest) / PART_DIR} — run the same command again to resume")
        return EXIT_FAIL
    except DownloadError as e:
        out.err(f"k3 download: FAIL {e}")
        return EXIT_FAIL
    except Exception as e:  # noqa: BLE001 - one masked line, never a traceback with headers
        out.err(f"k3 download: FAIL {type(e).__name__}: {e}")
        return EXIT_FAIL


def _run(args: argparse.Namespace, token: str | None, out: Out) -> int:
    dest = Path(args.dest)
    revision = args.revision or os.environ.get("K3_REVISION") or "main"
    endpoint = args.endpoint or os.environ.get("HF_ENDPOINT") or None
    checksum = not (args.skip_checksum or os.environ.get("K3_SKIP_CHECKSUM") == "1")

    # 1-2. expected figures
    hub: Hub | None = None
    try:
        hub = Hub(args.repo, revision, endpoint, token)
        out.say(f"k3 download: {args.repo} at {revision} from {hub.endpoint} "
                f"(token: {'HF_TOKEN, not shown' if token else 'none from HF_TOKEN'})")
        exp = fetch_expected(hub)
    except Exception as e:
        if not args.verify_only:
            raise
        exp = load_manifest(dest, args.repo)
        if exp is None:
            raise DownloadError(f"cannot read the expected figures: the hub failed "
                                f"({type(e).__name__}: {e}) and {dest / PART_DIR / MANIFEST} "
                                "does not exist") from None
        out.say(f"k3 download: hub not reachable ({type(e).__name__}); using the saved manifest")
    shards = exp.shards()
    if not args.verify_only:
        check_targets(dest, exp.files.values())
    out.say(f"commit {exp.commit}: {len(exp.files)} files, {len(shards)} shards, "
            f"{sum(exp.files[n].size for n in shards):,} shard bytes ({exp.source})")

    # 3. selection
    selected = list(exp.files)
    if args.layers is not None:
        if INDEX_JSON not in exp.files:
            raise DownloadError(f"--layers needs {INDEX_JSON}, which {exp.repo} does not list")
        if not args.verify_only:
            dest.mkdir(parents=True, exist_ok=True)
            idx = exp.files[INDEX_JSON]
            if not _complete(dest / INDEX_JSON, idx):
                fetch_file(hub, dest, idx, out, "[index]")
        try:
            weight_map = loads_strict(read_regular_file(dest / INDEX_JSON, INDEX_LIMIT, "index"),
                                      str(dest / INDEX_JSON))["weight_map"]
            if not (isinstance(weight_map, dict)
                    and all(isinstance(v, str) for v in weight_map.values())):
                raise TypeError("weight_map is not an object of shard names")
        except (InputFileError, JSONFormatError) as e:
            raise DownloadError(f"cannot read the weight map ({e})") from None
        except (KeyError, TypeError) as e:
            raise DownloadError(f"{dest / INDEX_JSON}: cannot read the weight map ({e})") from None
        need, n_total = shards_for_layers(weight_map, args.layers)
        if args.layers > n_total:
            out.err(f"k3 download: --layers {args.layers}: the checkpoint has {n_total} layers")
            return EXIT_USAGE
        unknown = sorted(need - set(exp.files))
        if unknown:
            raise DownloadError(f"{INDEX_JSON} maps tensors to {unknown[0]}, which the hub does "
                                "not list")
        selected = [n for n in exp.files if not SHARD_RE.match(n)] + sort_shards(need)
        out.say(f"--layers {args.layers}: {len(need)} of {len(shards)} shards hold layers "
                f"0..{args.layers - 1} and the model-level tensors")

    if args.verify_only:
        res = verify(dest, exp, selected, checksum, out, partial_of=args.layers)
        return EXIT_OK if res.ok else EXIT_FAIL

    # 4. plan and free space (every target was checked above, before the first byte)
    dest.mkdir(parents=True, exist_ok=True)
    save_manifest(dest, exp, hub.endpoint)
    todo: list[FileFigure] = []
    need_bytes = 0
    for name in _fetch_order(selected):
        fig = exp.files[name]
        if _complete(dest / name, fig):
            continue
        todo.append(fig)
        p = part_path(dest, fig)
        have = _part_size(p)
        need_bytes += fig.size - (have if have <= fig.size else 0)
    free = free_bytes(dest)
    skipped = len(selected) - len(todo)
    out.say(f"to fetch: {len(todo)} of {len(selected)} files, {need_bytes:,} bytes "
            f"({human(need_bytes)}); {human(free)} free on {dest}"
            + (f"; {skipped} already present with the expected size (verified below)"
               if skipped else ""))
    if need_bytes > free:
        out.err(f"k3 download: refusing to start: {need_bytes:,} bytes ({human(need_bytes)}) "
                f"still to fetch but only {free:,} bytes ({human(free)}) free on {dest}. "
                "Free space or choose another DEST.")
        return EXIT_FAIL

    # 5. fetch
    for i, fig in enumerate(todo, 1):
        fetch_file(hub, dest, fig, out, f"[{i}/{len(todo)}]")

    # 6. verify
    res = verify(dest, exp, selected, checksum, out, partial_of=args.layers)
    if res.ok:
        what = (f"layers 0..{args.layers - 1} ({len([n for n in selected if SHARD_RE.match(n)])}"
                f" of {exp.shard_count} shards; NOT the full model)" if args.layers
                else f"{exp.shard_count} shards")
        out.say(f"OK: {dest} holds {exp.repo}@{exp.commit[:12]}, {what}, verified")
        return EXIT_OK
    return EXIT_FAIL


def _fetch_order(names: list[str]) -> list[str]:
    small = sorted(n for n in names if not SHARD_RE.match(n))
    return small + sort_shards(n for n in names if SHARD_RE.match(n))


def _complete(path: Path, fig: FileFigure) -> bool:
    try:
        return path.is_file() and path.stat().st_size == fig.size
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

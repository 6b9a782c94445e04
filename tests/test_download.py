"""`k3 download` against a Hugging Face hub emulated on loopback (never the internet).

The fake hub implements exactly the requests huggingface_hub makes for this tool:
  GET  /api/models/{repo}[/revision/{rev}]?blobs=true   model_info(files_metadata=True)
  HEAD /{repo}/resolve/{rev}/{path}                     get_hf_file_metadata
  GET  /{repo}/resolve/{rev}/{path}                     small (non-LFS) files
and, on a second port (another origin, like the hub's CDN), the LFS blobs the resolve HEAD
redirects to, with HTTP Range support.  It logs every request it sees.
"""
from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlparse

import pytest

pytest.importorskip("huggingface_hub", reason="huggingface_hub (the download dependency) is "
                    "not installed")

from k3engine.tools import download as dl
from k3engine.tools.make_checkpoint import dims_config, make_checkpoint

REPO = "k3test/tiny-k3"
COMMIT = hashlib.sha1(b"k3 test commit").hexdigest()
TOKEN = "hf_SECRETtokenVALUE0123456789abcdef"
SERVER_LIFETIME = 120.0          # seconds; each fake hub shuts itself down after this


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# --- the fake hub --------------------------------------------------------------------------

class FakeHub:
    def __init__(self, files: dict[str, bytes], repo: str = REPO, token: str | None = TOKEN,
                 siblings: list[dict] | None = None):
        self.repo, self.token = repo, token
        self.files = dict(files)                    # what is served (tests may corrupt it)
        self.meta = {}                              # what the metadata says (computed now)
        for name, data in files.items():
            lfs = name.endswith(".safetensors")
            self.meta[name] = {"size": len(data), "oid": _git_oid(data),
                               "sha256": hashlib.sha256(data).hexdigest() if lfs else None}
        self.siblings_override = siblings
        self.requests: list[dict] = []
        self.truncate: dict[str, list[int]] = {}    # name -> [times left, cut at byte]
        self.lock = threading.Lock()
        self.hub = ThreadingHTTPServer(("127.0.0.1", 0), self._handler("hub"))
        self.cdn = ThreadingHTTPServer(("127.0.0.1", 0), self._handler("cdn"))
        self.endpoint = f"http://127.0.0.1:{self.hub.server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self.cdn.server_address[1]}"
        self.threads = [threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05},
                                         daemon=True) for s in (self.hub, self.cdn)]
        for t in self.threads:
            t.start()
        self.timer = threading.Timer(SERVER_LIFETIME, self.close)
        self.timer.daemon = True
        self.timer.start()

    def close(self) -> None:
        self.timer.cancel()
        for s in (self.hub, self.cdn):
            s.shutdown()
            s.server_close()

    # request log helpers
    def seen(self, server: str, method: str | None = None) -> list[dict]:
        return [r for r in self.requests if r["server"] == server
                and (method is None or r["method"] == method)]

    def blob_gets(self) -> list[dict]:
        return self.seen("cdn", "GET")

    def fetched_names(self) -> set[str]:
        names = {r["name"] for r in self.blob_gets()}
        return names | {r["name"] for r in self.seen("hub", "GET") if r.get("name")}

    def sibling_list(self) -> list[dict]:
        if self.siblings_override is not None:
            return self.siblings_override
        out = []
        for name, m in sorted(self.meta.items()):
            s = {"rfilename": name, "size": m["size"], "blobId": m["oid"]}
            if m["sha256"]:
                s["lfs"] = {"size": m["size"], "sha256": m["sha256"], "pointerSize": 134}
            out.append(s)
        return out

    def _handler(self, server: str):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a):          # quiet; the log is hub.requests
                pass

            def _log(self, **extra):
                rec = {"server": server, "method": self.command, "path": self.path,
                       "auth": self.headers.get("Authorization"),
                       "range": self.headers.get("Range"), **extra}
                with hub.lock:
                    hub.requests.append(rec)
                return rec

            def _send(self, code, headers=None, body=b""):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, str(v))
                if "Content-Length" not in (headers or {}):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD" and body:
                    self.wfile.write(body)

            def _error(self, code, error_code=None, msg="error"):
                h = {"Content-Type": "application/json", "X-Repo-Commit": COMMIT}
                if error_code:
                    h["X-Error-Code"] = error_code
                self._send(code, h, json.dumps({"error": msg}).encode())

            def _authorized(self) -> bool:
                return hub.token is None or \
                    self.headers.get("Authorization") == f"Bearer {hub.token}"

            def do_HEAD(self):
                self._route()

            def do_GET(self):
                self._route()

            def _route(self):
                u = urlparse(self.path)
                path = unquote(u.path)
                if server == "cdn":
                    return self._blob(path, parse_qs(u.query))
                m = re.fullmatch(r"/api/models/(.+?)(?:/revision/([^/]+))?", path)
                if m and self.command == "GET":
                    self._log(query=parse_qs(u.query))
                    return self._model_info(m.group(1), m.group(2))
                m = re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path)
                if m:
                    self._log(name=m.group(3) if self.command == "GET" else None)
                    return self._resolve(m.group(1), m.group(2), m.group(3))
                self._log()
                self._error(404, msg="no such route")

            def _model_info(self, repo, rev):
                if not self._authorized():
                    return self._error(401, msg="Invalid credentials in Authorization header")
                if repo != hub.repo:
                    return self._error(404, "RepoNotFound", "Repository not found")
                if rev not in (None, "main", COMMIT):
                    return self._error(404, "RevisionNotFound", "Invalid rev id")
                body = json.dumps({"id": repo, "modelId": repo, "sha": COMMIT, "private": True,
                                   "siblings": hub.sibling_list()}).encode()
                self._send(200, {"Content-Type": "application/json"}, body)

            def _resolve(self, repo, rev, name):
                if not self._authorized():
                    return self._error(401, msg="Invalid credentials in Authorization header")
                if repo != hub.repo:
                    return self._error(404, "RepoNotFound", "Repository not found")
                if rev not in ("main", COMMIT):
                    return self._error(404, "RevisionNotFound", "Invalid rev id")
                if name not in hub.meta:
                    return self._error(404, "EntryNotFound", "Entry not found")
                m = hub.meta[name]
                if m["sha256"]:                 # LFS: redirect to the CDN origin
                    return self._send(302, {
                        "Location": f"{hub.cdn_url}/blobs/{m['sha256']}?name={quote(name)}&sig=x",
                        "X-Repo-Commit": COMMIT, "ETag": f'"{m["oid"]}"',
                        "X-Linked-Etag": f'"{m["sha256"]}"', "X-Linked-Size": m["size"]})
                data = hub.files[name]
                self._send(200, {"X-Repo-Commit": COMMIT, "ETag": f'"{m["oid"]}"',
                                 "Content-Type": "application/octet-stream",
                                 "Content-Length": len(data)}, data)

            def _blob(self, path, query):
                name = query.get("name", [""])[0]
                rec = self._log(name=name)
                m = re.fullmatch(r"/blobs/([0-9a-f]{64})", path)
                if not m or name not in hub.meta or hub.meta[name]["sha256"] != m.group(1):
                    return self._send(404)
                data = hub.files[name]
                start, code = 0, 200
                headers = {"Accept-Ranges": "bytes", "ETag": f'"{m.group(1)}"',
                           "Content-Type": "application/octet-stream"}
                rng = self.headers.get("Range")
                if rng:
                    r = re.fullmatch(r"bytes=(\d+)-", rng)
                    start = int(r.group(1))
                    if start >= len(data):
                        return self._send(416, {"Content-Range": f"bytes */{len(data)}"})
                    code = 206
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                body = data[start:]
                headers["Content-Length"] = len(body)
                cut = None
                with hub.lock:
                    t = hub.truncate.get(name)
                    if t and t[0] > 0 and self.command == "GET":
                        t[0] -= 1
                        cut = max(0, t[1] - start)
                rec["truncated"] = cut is not None
                if cut is None:
                    return self._send(code, headers, body)
                # a dropped connection: full headers, part of the body, then close
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, str(v))
                self.end_headers()
                self.wfile.write(body[:cut])
                self.wfile.flush()
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        return Handler


# --- fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def source(tmp_path_factory) -> dict[str, bytes]:
    src = tmp_path_factory.mktemp("src")
    make_checkpoint(str(src), dims_config("tiny"), seed=1, shard_bytes=300_000)
    (src / "tokenizer_config.json").write_text('{"bos_token": "[BOS]"}\n')
    return {p.name: p.read_bytes() for p in sorted(src.iterdir()) if p.is_file()}


@pytest.fixture(autouse=True)
def hub_env(monkeypatch, tmp_path):
    """A clean huggingface_hub environment, and no way to reach anything but loopback."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("K3_REVISION", raising=False)
    monkeypatch.delenv("K3_SKIP_CHECKSUM", raising=False)
    for v in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    monkeypatch.setattr(dl, "RETRY_SLEEP_MAX", 0.0)

    real_getaddrinfo = socket.getaddrinfo

    def loopback_only(host, *a, **k):
        if host not in ("127.0.0.1", "localhost", "::1", b"127.0.0.1"):
            raise OSError(f"test guard: refused to resolve {host!r} (loopback only)")
        return real_getaddrinfo(host, *a, **k)

    monkeypatch.setattr(socket, "getaddrinfo", loopback_only)


@pytest.fixture
def hub(source):
    h = FakeHub(source)
    yield h
    h.close()


def run(capsys, *argv) -> tuple[int, str, str]:
    code = dl.main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def args(h: FakeHub, dest: Path, *extra) -> list:
    return [dest, "--repo", h.repo, "--endpoint", h.endpoint, *extra]


def shard_names(files) -> list[str]:
    return sorted(n for n in files if dl.SHARD_RE.match(n))


# --- the published table -------------------------------------------------------------------

def test_published_table_matches_spec():
    t = dl.PUBLISHED_SHARD_SIZES
    assert len(t) == 96 and sum(t.values()) == 1_560_936_091_448
    assert t["model-00001-of-000096.safetensors"] == 2_341_216_112
    assert t["model-00004-of-000096.safetensors"] == 16_567_501_776
    assert t["model-00010-of-000096.safetensors"] == 16_990_911_504
    assert t["model-00011-of-000096.safetensors"] == 16_990_916_912
    assert t["model-00012-of-000096.safetensors"] == 16_567_507_176
    assert t["model-00091-of-000096.safetensors"] == 16_990_916_912
    assert t["model-00092-of-000096.safetensors"] == 16_567_507_176
    assert t["model-00093-of-000096.safetensors"] == 16_567_507_176
    assert t["model-00094-of-000096.safetensors"] == 4_697_664_072
    assert t["model-00095-of-000096.safetensors"] == 92_289_328
    assert t["model-00096-of-000096.safetensors"] == 802_448_352
    assert dl.REAL_REPO_ID == _parser_default_repo()


def _parser_default_repo() -> str:
    return dl._parser().parse_args(["x"]).repo


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        dl.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--repo", "--revision", "--endpoint", "--layers", "--verify-only",
                 "--skip-checksum", "HF_TOKEN"):
        assert flag in out


# --- downloads -----------------------------------------------------------------------------

def test_full_download_verifies_and_rerun_fetches_nothing(hub, source, tmp_path, capsys):
    dest = tmp_path / "model"
    code, out, err = run(capsys, *args(hub, dest))
    assert code == 0, err
    for name, data in source.items():
        assert (dest / name).read_bytes() == data
    n = len(shard_names(source))
    assert f"shards: {n} of {n} verified" in out
    assert "OK: " in out and "checksums:" in out and "MB/s" in out
    assert COMMIT in out
    # one metadata call with blobs, then HEAD resolve per file at the resolved commit
    info = hub.seen("hub", "GET")[0]
    assert info["path"].startswith(f"/api/models/{REPO}/revision/main")
    assert info["query"].get("blobs") == ["true"]
    heads = hub.seen("hub", "HEAD")
    assert len(heads) == len(source)
    assert all(f"/resolve/{COMMIT}/" in r["path"] for r in heads)
    # the token goes to the hub, never to the CDN origin, and is never printed
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in hub.seen("hub"))
    assert hub.blob_gets() and all(r["auth"] is None for r in hub.blob_gets())
    assert TOKEN not in out + err
    assert {r["name"] for r in hub.blob_gets()} == set(shard_names(source))

    before = len(hub.requests)
    code, out, err = run(capsys, *args(hub, dest))
    assert code == 0, err
    assert "to fetch: 0 of" in out
    assert not [r for r in hub.requests[before:] if r["method"] == "GET" and r["server"] == "cdn"]


def test_endpoint_from_hf_endpoint_env(hub, source, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    code, out, err = run(capsys, tmp_path / "m", "--repo", REPO, "--layers", "1")
    assert code == 0, err
    assert hub.endpoint in out


def test_dropped_connection_resumes_with_range(hub, source, tmp_path, capsys):
    shard = shard_names(source)[2]
    cut = len(source[shard]) // 2
    hub.truncate[shard] = [1, cut]                  # the first GET of this blob dies halfway
    dest = tmp_path / "model"
    code, out, err = run(capsys, *args(hub, dest))
    assert code == 0, err
    gets = [r for r in hub.blob_gets() if r["name"] == shard]
    assert [r["range"] for r in gets] == [None, f"bytes={cut}-"]
    assert gets[0]["truncated"] and not gets[1]["truncated"]
    assert f"{shard}: connection lost" in out and "resumed after 1 dropped" in out
    assert (dest / shard).read_bytes() == source[shard]


def test_interrupted_run_is_resumed_by_the_next_run(hub, source, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(dl, "MAX_ATTEMPTS", 2)
    shard = shard_names(source)[4]
    cut = len(source[shard]) // 3
    hub.truncate[shard] = [2, cut]                  # both attempts of the first run die
    dest = tmp_path / "model"
    code, out, err = run(capsys, *args(hub, dest))
    assert code == 1
    assert shard in err and "run the same command again to resume" in err
    part = dl.part_path(dest, dl.FileFigure(shard, len(source[shard]),
                                            hub.meta[shard]["sha256"]))
    assert part.stat().st_size == cut
    assert not (dest / shard).exists()

    before = len(hub.requests)
    code, out, err = run(capsys, *args(hub, dest))
    assert code == 0, err
    gets = [r for r in hub.requests[before:] if r["server"] == "cdn" and r["name"] == shard]
    assert [r["range"] for r in gets] == [f"bytes={cut}-"]
    assert f"{shard}: resuming at" in out
    assert (dest / shard).read_bytes() == source[shard]
    assert not part.exists()


def test_corrupted_served_shard_is_named(hub, source, tmp_path, capsys):
    shard = shard_names(source)[4]
    bad = bytearray(source[shard])
    bad[len(bad) // 2] ^= 0x01                      # flipped after the metadata was computed
    hub.files[shard] = bytes(bad)
    code, out, err = run(capsys, *args(hub, tmp_path / "model"))
    assert code == 1
    want = hub.meta[shard]["sha256"]
    got = hashlib.sha256(bad).hexdigest()
    assert f"FAIL {shard}: sha256 {got}, expected {want}" in err
    assert "1 of 14 shards are missing or wrong" in err
    assert "A partial download cannot run the model." in err
    assert "OK: " not in out


def test_verify_only_names_corruption_wrong_size_missing_and_stray(hub, source, tmp_path,
                                                                    capsys, monkeypatch):
    dest = tmp_path / "model"
    assert run(capsys, *args(hub, dest))[0] == 0
    shards = shard_names(source)
    code, out, err = run(capsys, *args(hub, dest, "--verify-only"))
    assert code == 0, err
    before = len(hub.requests)

    # a flipped byte: sha256 names it; --skip-checksum and K3_SKIP_CHECKSUM check sizes only
    p = dest / shards[1]
    data = bytearray(p.read_bytes())
    data[100] ^= 0xFF
    p.write_bytes(data)
    code, out, err = run(capsys, *args(hub, dest, "--verify-only"))
    assert code == 1 and f"FAIL {shards[1]}: sha256" in err
    assert run(capsys, *args(hub, dest, "--verify-only", "--skip-checksum"))[0] == 0
    monkeypatch.setenv("K3_SKIP_CHECKSUM", "1")
    assert run(capsys, *args(hub, dest, "--verify-only"))[0] == 0
    monkeypatch.delenv("K3_SKIP_CHECKSUM")
    p.write_bytes(source[shards[1]])

    # a small non-LFS file is checked against its git blob id
    (dest / "config.json").write_bytes(source["config.json"].replace(b"1", b"2", 1))
    code, out, err = run(capsys, *args(hub, dest, "--verify-only"))
    assert code == 1 and "FAIL config.json: git blob id" in err
    (dest / "config.json").write_bytes(source["config.json"])

    # a wrong size
    p = dest / shards[6]
    p.write_bytes(source[shards[6]][:-10])
    n = len(source[shards[6]])
    code, out, err = run(capsys, *args(hub, dest, "--verify-only"))
    assert code == 1
    assert f"FAIL {shards[6]}: {n - 10:,} bytes, expected {n:,}" in err

    # a missing shard
    p.unlink()
    code, out, err = run(capsys, *args(hub, dest, "--verify-only"))
    assert code == 1 and f"FAIL {shards[6]}: missing" in err
    assert "1 of 14 shards are missing or wrong" in err
    p.write_bytes(source[shards[6]])

    # a stray shard the engine would also read
    (dest / "model-00015-of-00015.safetensors").write_bytes(b"x")
    code, out, err = run(capsys, *args(hub, dest, "--verify-only"))
    assert code == 1 and "model-00015-of-00015.safetensors: not a shard of" in err
    (dest / "model-00015-of-00015.safetensors").unlink()

    assert run(capsys, *args(hub, dest, "--verify-only"))[0] == 0
    assert not [r for r in hub.requests[before:] if r["server"] == "cdn"]


def test_verify_only_uses_the_saved_manifest_when_the_hub_is_down(hub, source, tmp_path,
                                                                  capsys):
    dest = tmp_path / "model"
    assert run(capsys, *args(hub, dest))[0] == 0
    endpoint = hub.endpoint
    hub.close()
    code, out, err = run(capsys, dest, "--repo", REPO, "--endpoint", endpoint, "--verify-only")
    assert code == 0, err
    assert "saved manifest" in out
    code, out, err = run(capsys, dest, "--repo", REPO, "--endpoint", endpoint)
    assert code == 1 and "FAIL" in err


def test_layers_fetches_only_the_needed_shards(hub, source, tmp_path, capsys):
    dest = tmp_path / "model"
    code, out, err = run(capsys, *args(hub, dest, "--layers", "2"))
    assert code == 0, err
    wm = json.loads(source[dl.INDEX_JSON])["weight_map"]
    need = {wm[n] for n in wm if re.search(r"\.layers\.[01]\.", n) or ".layers." not in n}
    shards = shard_names(source)
    assert need == {shards[0], shards[1], shards[12], shards[13]}   # embed+L0, L1, norms, head
    assert {r["name"] for r in hub.blob_gets()} == need
    present = {p.name for p in dest.iterdir() if p.is_file()}
    assert present == need | {n for n in source if not dl.SHARD_RE.match(n)}
    assert "4 of 14 shards hold layers 0..1" in out
    assert "NOT the full model" in out

    code, out, err = run(capsys, *args(hub, dest, "--layers", "2", "--verify-only"))
    assert code == 0, err
    code, out, err = run(capsys, *args(hub, dest, "--verify-only"))
    assert code == 1 and "10 of 14 shards are missing or wrong" in err
    code, out, err = run(capsys, *args(hub, dest, "--layers", "14"))
    assert code == 2 and "the checkpoint has 13 layers" in err


def test_token_is_sent_and_never_echoed(source, tmp_path, capfd, monkeypatch):
    # capfd, not capsys: also catches anything the library logs straight to fd 1 or 2
    capsys = capfd
    h = FakeHub(source)
    try:
        code, out, err = run(capsys, *args(h, tmp_path / "a", "--layers", "1"))
        assert code == 0, err
        assert all(r["auth"] == f"Bearer {TOKEN}" for r in h.seen("hub"))
        assert TOKEN not in out + err and "not shown" in out
        # a rejected token: the failure is reported, the token still is not
        monkeypatch.setenv("HF_TOKEN", TOKEN + "x")
        code, out, err = run(capsys, *args(h, tmp_path / "b"))
        assert code == 1 and "FAIL" in err and "401" in err
        assert TOKEN not in out + err
        # the masking filter itself: even a message carrying the token prints ***
        o = dl.Out([TOKEN])
        assert TOKEN not in o.mask(f"Authorization: Bearer {TOKEN}")
    finally:
        h.close()


def test_free_space_refusal(hub, source, tmp_path, capsys, monkeypatch):
    class St:
        f_bavail, f_frsize = 100, 4096                 # 409,600 bytes free
    monkeypatch.setattr(dl.os, "statvfs", lambda p: St())
    dest = tmp_path / "model"
    code, out, err = run(capsys, *args(hub, dest))
    assert code == 1
    total = sum(len(d) for d in source.values())
    assert f"refusing to start: {total:,} bytes" in err and "409,600 bytes" in err
    assert not hub.blob_gets() and not hub.seen("hub", "HEAD")
    assert not [p for p in dest.iterdir() if p.is_file()]


def _real_siblings(lie: dict[str, int] | None = None) -> list[dict]:
    sib = [{"rfilename": "config.json", "size": 100, "blobId": "0" * 40}]
    for name, size in dl.PUBLISHED_SHARD_SIZES.items():
        size = (lie or {}).get(name, size)
        sib.append({"rfilename": name, "size": size, "blobId": "1" * 40,
                    "lfs": {"size": size, "sha256": "2" * 64, "pointerSize": 135}})
    return sib


def test_real_repo_is_held_to_the_published_table(source, tmp_path, capsys, monkeypatch):
    # a generated checkpoint served under the real id cannot pass
    h = FakeHub(source, repo=dl.REAL_REPO_ID)
    try:
        code, out, err = run(capsys, tmp_path / "a", "--endpoint", h.endpoint)
        assert code == 1
        assert "disagrees with the published shard table" in err
        assert "model-00001-of-000096.safetensors is missing from the hub's listing" in err
        assert not h.seen("hub", "HEAD") and not h.blob_gets()
    finally:
        h.close()
    # a listing that matches the table except one lying size is named before any fetch
    lie = "model-00007-of-000096.safetensors"
    h = FakeHub({}, repo=dl.REAL_REPO_ID, siblings=_real_siblings({lie: 16_990_911_503}))
    try:
        code, out, err = run(capsys, tmp_path / "b", "--endpoint", h.endpoint)
        assert code == 1
        assert f"{lie}: the hub lists 16,990,911,503 bytes, the published size is " \
               "16,990,911,504" in err
        assert not h.seen("hub", "HEAD")
    finally:
        h.close()
    # an honest listing of the real checkpoint: refused for space (1.56 TB) before any fetch
    h = FakeHub({}, repo=dl.REAL_REPO_ID, siblings=_real_siblings())

    class St:
        f_bavail, f_frsize = 10 ** 9, 1000           # 1 TB free
    monkeypatch.setattr(dl.os, "statvfs", lambda p: St())
    try:
        code, out, err = run(capsys, tmp_path / "c", "--endpoint", h.endpoint)
        assert code == 1
        assert "96 shards, 1,560,936,091,448 shard bytes" in out
        assert "refusing to start: 1,560,936,091,548 bytes" in err
        assert not h.seen("hub", "HEAD")
    finally:
        h.close()


def test_revision_is_resolved_once_and_bad_revision_fails(hub, source, tmp_path, capsys,
                                                          monkeypatch):
    monkeypatch.setenv("K3_REVISION", COMMIT)
    code, out, err = run(capsys, *args(hub, tmp_path / "a", "--layers", "1"))
    assert code == 0, err
    assert hub.seen("hub", "GET")[0]["path"].startswith(f"/api/models/{REPO}/revision/{COMMIT}")
    code, out, err = run(capsys, *args(hub, tmp_path / "b", "--revision", "nope"))
    assert code == 1 and "FAIL" in err


# --- hostile names in the hub's listing (issue 14, finding 1) ------------------------------

def _only_metadata_was_asked(h: FakeHub) -> bool:
    return not h.blob_gets() and not [r for r in h.seen("hub") if r.get("name")]


@pytest.mark.parametrize("bad", ["../../escaped_rel.txt", "../x", "a/../../x", "./x", "a//b",
                                 "x\\..\\..\\y", ".k3-download/manifest.json", "c\x00d"])
def test_relative_escape_is_refused_before_any_byte(source, tmp_path, capsys, bad):
    outside = tmp_path / "escaped_rel.txt"
    outside.write_text("precious\n")
    h = FakeHub({**source, bad: b"pwned\n"})
    try:
        dest = tmp_path / "d1" / "d2" / "model"
        code, out, err = run(capsys, *args(h, dest))
    finally:
        h.close()
    assert code == 1 and "OK: " not in out
    assert repr(bad[:120]) in err or bad in err
    assert outside.read_text() == "precious\n"
    assert not (tmp_path / "x").exists() and not (tmp_path / "d1" / "x").exists()
    assert not dest.exists()                         # decided before anything was written
    assert _only_metadata_was_asked(h)


def test_absolute_name_is_refused(source, tmp_path, capsys):
    target = tmp_path / "abs_target.txt"
    target.write_text("precious\n")
    h = FakeHub({**source, str(target): b"pwned\n"})
    try:
        code, out, err = run(capsys, *args(h, tmp_path / "model"))
    finally:
        h.close()
    assert code == 1 and "an absolute path" in err and str(target) in err
    assert target.read_text() == "precious\n"
    assert not (tmp_path / "model").exists() and _only_metadata_was_asked(h)


@pytest.mark.parametrize("where", ["dir", "file", "partdir"])
def test_symlink_inside_dest_is_refused(source, tmp_path, capsys, where):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.json").write_text("precious\n")
    dest = tmp_path / "model"
    dest.mkdir()
    files = dict(source)
    if where == "dir":                               # DEST/sub -> outside, hub lists sub/x
        (dest / "sub").symlink_to(outside, target_is_directory=True)
        files["sub/victim.json"] = b"pwned\n"
        link = dest / "sub"
    elif where == "file":                            # DEST/config.json -> outside file
        (dest / "config.json").symlink_to(outside / "victim.json")
        link = dest / "config.json"
    else:                                            # DEST/.k3-download -> outside
        (dest / dl.PART_DIR).symlink_to(outside, target_is_directory=True)
        link = dest / dl.PART_DIR
    h = FakeHub(files)
    try:
        code, out, err = run(capsys, *args(h, dest))
    finally:
        h.close()
    assert code == 1 and f"{link} is a symbolic link" in err
    assert (outside / "victim.json").read_text() == "precious\n"
    assert sorted(p.name for p in outside.iterdir()) == ["victim.json"]
    assert _only_metadata_was_asked(h)


def _plant_in_part_dir(dest: Path, outside: Path, where: str, files: dict) -> Path:
    """Issue 47: a link already inside DEST/.k3-download (manifest, a partial file, a
    folder of partial files) pointing at outside/victim.json or at outside/."""
    part_dir = dest / dl.PART_DIR
    part_dir.mkdir(parents=True)
    if where == "manifest":
        link = part_dir / dl.MANIFEST
        link.symlink_to(outside / "victim.json")
    elif where == "incomplete":
        data = files["config.json"]
        fig = dl.FileFigure("config.json", len(data), None, _git_oid(data))
        link = dl.part_path(dest, fig)
        link.symlink_to(outside / "victim.json")
    else:                                            # .k3-download/sub -> outside/
        files["sub/victim.json"] = b"pwned\n"
        link = part_dir / "sub"
        link.symlink_to(outside, target_is_directory=True)
    return link


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "raced"])
@pytest.mark.parametrize("where", ["manifest", "incomplete", "partsub"])
def test_symlink_inside_the_part_dir_is_never_written_through(source, tmp_path, capsys,
                                                             monkeypatch, where, checked):
    """Issue 47, finding 1.  `checked`: refused by check_targets before the first byte;
    `raced` (check_targets skipped, as if the link appeared after it): the O_NOFOLLOW opens
    still refuse it.  Either way the victim keeps its bytes and nothing lands outside."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.json").write_text("precious\n")
    dest = tmp_path / "model"
    files = dict(source)
    link = _plant_in_part_dir(dest, outside, where, files)
    if not checked:
        monkeypatch.setattr(dl, "check_targets", lambda *a: None)
    h = FakeHub(files)
    try:
        code, out, err = run(capsys, *args(h, dest))
    finally:
        h.close()
    assert code == 1
    assert str(link) in err and "symbolic link" in err and "Traceback" not in err
    assert (outside / "victim.json").read_text() == "precious\n"
    assert sorted(p.name for p in outside.iterdir()) == ["victim.json"]
    assert link.is_symlink()                         # refused, not replaced


@pytest.mark.parametrize("pair", [("Config.json", "config.json"), ("caf\u00e9.txt", "cafe\u0301.txt"),
                                  ("a", "a/b")])
def test_name_collision_is_refused(source, tmp_path, capsys, pair):
    h = FakeHub({**source, pair[0]: b"one\n", pair[1]: b"two\n"})
    try:
        code, out, err = run(capsys, *args(h, tmp_path / "model"))
    finally:
        h.close()
    assert code == 1 and (repr(pair[0]) in err or repr(pair[1]) in err)
    assert not (tmp_path / "model").exists() and _only_metadata_was_asked(h)


def test_plain_subdirectory_names_still_download(source, tmp_path, capsys):
    h = FakeHub({**source, "original/notes.txt": b"fine\n"})
    try:
        code, out, err = run(capsys, *args(h, tmp_path / "model"))
    finally:
        h.close()
    assert code == 0, err
    assert (tmp_path / "model" / "original" / "notes.txt").read_bytes() == b"fine\n"


def test_bad_sizes_and_hashes_in_the_listing_are_refused(source, tmp_path, capsys):
    probe = FakeHub(source)
    sib = probe.sibling_list()
    probe.close()
    for s, bad in zip(sib[:2], ({"size": True}, {"size": -1})):
        s.update(bad)
    h = FakeHub(source, siblings=sib)
    try:
        code, out, err = run(capsys, *args(h, tmp_path / "model"))
    finally:
        h.close()
    assert code == 1 and "the size" in err and "Traceback" not in err


def test_download_state_of_a_folder(hub, source, tmp_path, capsys):
    """What the app's pickers read (download.download_state): None without the tool's
    manifest, the shards done and the bytes while unfinished, complete once verified."""
    dest = tmp_path / "model"
    dest.mkdir()
    assert dl.download_state(dest) is None                    # not a download of ours
    code, _, _ = run(capsys, *args(hub, dest))
    assert code == 0
    st = dl.download_state(dest)
    assert st.complete and st.shards == st.shards_done == len(shard_names(source))
    assert st.repo == hub.repo and st.endpoint == hub.endpoint
    assert st.bytes_done == st.bytes_total == sum(len(d) for d in source.values())
    shards = shard_names(source)
    (dest / shards[5]).unlink()                                # one shard gone again
    st = dl.download_state(dest)
    assert not st.complete and st.shards_done == len(shards) - 1 and st.files_left == 1
    assert st.line().startswith(f"partial download: {len(shards) - 1} of {len(shards)} shards;")

"""The run report's formats (SYSTEM §6.7, §7): the step line, the --out JSON line and the
generated-text escaping, shared by every command that prints or writes them."""
from __future__ import annotations

STEP_HEADER = f"{'STEP':<6} {'TOKEN':<10} {'SECONDS':<12} {'CACHE HIT':<10} {'READ GB':<10} TOK/S"
RULE = "-" * 68

OUT_KEYS = ("prompt_ids", "generated_ids", "full_ids", "layers", "layers_requested",
            "layers_completed", "expert_drops", "peak_rss_bytes", "wall_seconds",
            "seconds_per_token", "expert_bytes_read", "trunk_bytes_read", "embedding_bytes_read",
            "lm_head_bytes_read", "ultra_low_memory", "stopped_at", "interrupted",
            "generated_text")


def step_line(step: int, token: int, seconds: float, hit_pct: float, read_bytes: int) -> str:
    rate = 1 / seconds if seconds > 0 else 0.0
    return f"{step:<6d} {token:<10d} {seconds:<12.2f} {hit_pct:<10.1f} {read_bytes / 1e9:<10.2f} {rate:.3f}"


def json_bytes(b: bytes) -> bytes:
    """The reference's string escaping: \\" \\\\ \\b \\f \\n \\r \\t, other bytes < 0x20 as
    \\u00xx (lowercase hex), everything else raw (bytes >= 0x80 unchanged, so text that
    ends mid-character is kept exactly)."""
    out = bytearray(b'"')
    esc = {0x22: b'\\"', 0x5C: b"\\\\", 0x08: b"\\b", 0x0C: b"\\f", 0x0A: b"\\n",
           0x0D: b"\\r", 0x09: b"\\t"}
    for c in b:
        if c in esc:
            out += esc[c]
        elif c < 0x20:
            out += b"\\u%04x" % c
        else:
            out.append(c)
    out += b'"'
    return bytes(out)


def out_line(values: dict, extra: dict | None = None) -> bytes:
    """One line, keys in the §6.7 order, no spaces, the reference's number formats; then
    the `extra` keys (SF extensions) in their given order."""
    parts = [b'"' + k.encode() + b'":' + _value(k, values[k]) for k in OUT_KEYS]
    parts += [b'"' + k.encode() + b'":' + _value(k, v) for k, v in (extra or {}).items()]
    return b"{" + b",".join(parts) + b"}\n"


def _value(k: str, v) -> bytes:
    if k == "peak_rss_bytes":
        return f"{v:.0f}".encode()
    if k in ("wall_seconds", "seconds_per_token"):
        return f"{v:.4f}".encode()
    if isinstance(v, bool):
        return b"true" if v else b"false"
    if isinstance(v, (list, tuple)):
        return ("[" + ",".join(str(int(i)) for i in v) + "]").encode()
    if v is None:
        return b"null"
    if isinstance(v, bytes):
        return json_bytes(v)
    if isinstance(v, str):
        return json_bytes(v.encode("utf-8", errors="surrogateescape"))
    if isinstance(v, float):
        return repr(v).encode()
    return str(int(v)).encode()

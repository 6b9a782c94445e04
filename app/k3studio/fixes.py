"""Refusals a person can cause, said as one sentence of cause and one of fix.

The engine's messages are exact and name the file (they stay available as the detail);
this module recognises the ones a person runs into by choosing directories or budgets and
says what happened and what to do.  Pure Python: the error banner (window.py) and the
setup checks (setup_panel.py) both render an `Advice`.  A message no rule knows gets no
advice: the detail alone is shown, never a guess.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Advice:
    cause: str
    fix: str
    detail: str             # the engine's own message, for the expandable part


# (pattern over the engine's message, cause, fix), first match wins.  Each names one
# refusal of the issue: an unfinished download of ours (checks.py found its manifest), not
# a folder, not a model, incomplete download, trunk of another model / out of date,
# tokenizer missing, budget over memory.
RULES: tuple[tuple[str, str, str], ...] = (
    (r"^partial download: \d+ of \d+ shards",
     "This folder holds a download that has not finished.",
     "Resume it in the Download tab (Resume download, below): it continues from the "
     "bytes already fetched."),
    (r"not a directory|cannot list .* \(No such file",
     "This path is not a folder.",
     "Choose the folder that holds the model's config.json and .safetensors files."),
    (r"no config\.json|refusing to guess the architecture",
     "This folder is not a model: it has no config.json.",
     "Choose the folder of a downloaded checkpoint (config.json with *.safetensors), or "
     "run the demo model (Create the demo model, above)."),
    (r"no \.safetensors files",
     "This folder has a config.json but no weights (.safetensors files).",
     "Finish the download into this folder, or choose the folder that has the shards."),
    (r"trunk\.(bin|json).*(passes the end|short read|truncated|cannot read)|"
     r"(passes the end|short read).*trunk\.bin",
     "The packed trunk is damaged or out of date (its file is shorter than its index says).",
     "Pack the trunk again from this model (Setup → Pack trunk…)."),
    (r"shard named in .* is missing|partial download|impossible data_offsets|short read|"
     r"passes the end of|missing tensor|belong to no tensor|is truncated|overlaps",
     "The checkpoint is incomplete: a shard is missing or cut short (an unfinished or "
     "damaged download).",
     "Resume the download (k3 download checks every shard's size), then choose the folder "
     "again."),
    (r"packed trunk has \d+ layers, need|holds the trunk of a different model|"
     r"trunk does not belong to",
     "The packed trunk was made from another model (or an earlier version of this one).",
     "Pack the trunk again from this model (Setup → Pack trunk…), or choose the trunk "
     "folder packed from it."),
    (r"no trunk\.json|missing trunk\.bin",
     "The trunk folder holds no packed trunk.",
     "Pack one (Setup → Pack trunk…) or clear the trunk field to run with the trunk in RAM."),
    (r"tiktoken\.model|tokenizer_config\.json|control token|not this model's tokenizer",
     "The tokenizer is missing or does not belong to this model.",
     "Choose the folder with this model's tiktoken.model and tokenizer_config.json (usually "
     "the model folder itself)."),
    (r"REFUSING TO START: this needs|plan may use at most|exceeds the budget|"
     r"KV cache for \d+ positions needs",
     "The memory this needs is more than the machine has available.",
     "Pick a smaller preset or lower the expert cache on the Memory tab (Apply), or close "
     "other programs."),
)


def advice(message: str) -> Advice | None:
    for pattern, cause, fix in RULES:
        if re.search(pattern, message):
            return Advice(cause, fix, message)
    return None


def check_text(message: str) -> str:
    """A setup check's line: cause and fix first, the engine's words after them."""
    a = advice(message)
    return f"{a.cause} {a.fix}\n({message})" if a else message

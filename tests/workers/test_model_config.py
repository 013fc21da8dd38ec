"""A checkpoint's config.json is parsed once per process, and again only if it changes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pagedray.workers.model_config import ModelConfig


def test_parsed_once_and_again_when_the_file_changes(tiny_llama: str, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    first = ModelConfig.from_pretrained(model)
    assert ModelConfig.from_pretrained(str(model)) is first  # the same parse, by any spelling
    assert ModelConfig.from_pretrained(model, "float32").dtype.is_floating_point
    raw = json.loads((model / "config.json").read_text())
    raw["num_hidden_layers"] += 1
    (model / "config.json").write_text(json.dumps(raw))
    stat = (model / "config.json").stat()
    os.utime(model / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    changed = ModelConfig.from_pretrained(model)
    assert changed.num_hidden_layers == first.num_hidden_layers + 1

"""`chat_template` (vLLM's `--chat-template`): a Jinja file, or the template itself, renders every
chat request in place of the tokenizer's own. A value that looks like a path but names no file
is refused when the settings are made, as vLLM refuses it. Served through the OpenAI server over
HTTP: `/tokenize` and a chat completion through the official SDK."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from pagedray.engine.config import EngineConfig
from pagedray.openai.local_app import local_openai_app

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hello"}]


def test_a_file_or_the_template_itself(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    config = EngineConfig(model="m", chat_template=str(path))
    assert config.chat_template == TEMPLATE
    assert EngineConfig(model="m", chat_template=TEMPLATE).chat_template == TEMPLATE
    # Each replica validates the settings again: the text stays the text, however long (a
    # real template's first line is no file name: over 255 bytes, stat() fails otherwise).
    long = "{# " + "x" * 5000 + " #}/" + TEMPLATE
    again = EngineConfig(**EngineConfig(model="m", chat_template=long).model_dump())
    assert again.chat_template == long
    assert EngineConfig(**config.model_dump()).chat_template == TEMPLATE
    assert EngineConfig(model="m", chat_template="None").chat_template is None
    with pytest.raises(ValueError, match="chat_template\n.*looks like a path"):
        EngineConfig(model="m", chat_template=str(tmp_path / "missing.jinja"))


def test_served_chat_is_rendered_with_the_given_template(tiny_llama: str, tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    expected = tokenizer.encode("<user> Hello\n<assistant> ", add_special_tokens=False)
    own = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert tokenizer.encode(own, add_special_tokens=False) != expected  # the test can tell
    config = EngineConfig(
        model=tiny_llama,
        num_kv_blocks=64,
        max_num_seqs=4,
        served_model_name=["x"],
        chat_template=str(path),
    )
    with TestClient(local_openai_app(config)) as http:  # its lifespan stops the engine
        tokenized = http.post("/tokenize", json={"model": "x", "messages": MESSAGES})
        assert tokenized.json()["tokens"] == expected
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
        answer = sdk.chat.completions.create(model="x", messages=MESSAGES, max_tokens=4)
        assert answer.usage is not None and answer.usage.prompt_tokens == len(expected)

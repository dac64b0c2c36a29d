"""A Gemma 3 GGUF (`general.architecture = gemma3`, as llama.cpp writes the text model of every Gemma 3)
with its sentencepiece vocabulary and chat template: the template renders the conversation, its turn
markers stay single tokens, the end-of-turn token stops generation, and a chat is answered."""

import pytest

from llmserve import LLM, SamplingParams
from llmserve.model_loader import load_arch_config, load_tokenizer

from .test_family_gguf import TINY, write_gguf

gguf = pytest.importorskip("gguf")

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]  # ids 1, 2: write_gguf's
WORDS = ["\u2581", "\n", *"abcdefghijklmnopqrstuvwxyz", "us", "er", "user", "mo", "de", "del", "model", "hi"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
END_OF_TURN = SPECIAL.index("<end_of_turn>")


def _tokenizer(writer) -> None:
    unused = [f"<unused{i}>" for i in range(TINY["vocab_size"] - len(SPECIAL) - len(WORDS))]
    tokens = SPECIAL + WORDS + unused
    control, normal, unused_type = (gguf.TokenType.CONTROL, gguf.TokenType.NORMAL, gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([control] * len(SPECIAL) + [normal] * len(WORDS) + [unused_type] * len(unused))
    writer.add_unk_token_id(SPECIAL.index("<unk>"))
    writer.add_eot_token_id(END_OF_TURN)
    writer.add_add_bos_token(True)
    writer.add_chat_template(TEMPLATE)


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-gguf") / "tiny-gemma3.gguf"
    write_gguf(path, "gemma3", _tokenizer)
    return str(path)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))


def test_the_chat_template_renders_the_conversation(gemma3_gguf):
    tokenizer = load_tokenizer(gemma3_gguf)
    assert tokenizer.chat_template_text() == TEMPLATE
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    )
    assert ids.count(SPECIAL.index("<start_of_turn>")) == 2 and ids.count(END_OF_TURN) == 1


def test_a_chat_is_answered_and_the_end_of_turn_stops_it(gemma3_gguf):
    assert END_OF_TURN in load_arch_config(gemma3_gguf).eos_token_ids
    llm = LLM(gemma3_gguf, dtype="float32", max_model_len=128, kv_cache_memory="8MiB")
    try:
        assert END_OF_TURN in llm.engine.eos_token_ids
        (output,) = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=8))
        assert output.prompt_token_ids[0] == SPECIAL.index("<bos>")
        assert 0 < len(output.outputs[0].token_ids) <= 8
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("layers", "scalar"), [(34, 128.0), (62, 168.0)])
def test_the_27b_scales_attention_by_hidden_over_heads(tmp_path, layers, scalar):
    """llama.cpp picks Gemma 3's attention scale by size: 1/sqrt(hidden / heads) for the 27B (62
    layers: 5376 / 32 = 168), 1/sqrt(head_dim) for the others (the metadata of a 27B, head_dim 128)."""
    from llmserve.model_loader.gguf_loader import open_gguf, read_arch_config

    path = str(tmp_path / "header-only.gguf")
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_block_count(layers)
    writer.add_context_length(131072)
    writer.add_embedding_length(5376)
    writer.add_feed_forward_length(21504)
    writer.add_head_count(32)
    writer.add_head_count_kv(16)
    writer.add_key_length(128)
    writer.add_value_length(128)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(262208)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_arch_config(open_gguf(path), path).query_pre_attn_scalar == scalar

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfold.errors import ConfigError
from kvfold.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def stream(tok, ids) -> list[str]:
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    return pieces


# --- byte tokenizer -------------------------------------------------------------------------


def test_byte_ids_and_specials():
    tok = ByteTokenizer()
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258)
    assert tok.encode("Aé") == [0x41, 0xC3, 0xA9]
    assert tok.decode([256, 0x41, 257, 0xC3, 0xA9, 257]) == "Aé"


def test_byte_rejects_small_vocab():
    with pytest.raises(ConfigError):
        ByteTokenizer(vocab_size=257)


def test_byte_invalid_utf8_is_replaced_not_raised():
    assert ByteTokenizer().decode([0x41, 0xFF, 0x42]) == "A\ufffdB"


def test_byte_stream_holds_split_multibyte_characters():
    tok = ByteTokenizer()
    ids = tok.encode("a€😀")  # 1 + 3 + 4 bytes
    pieces = stream(tok, ids)
    assert pieces == ["a", "", "", "€", "", "", "", "😀", ""]


def test_byte_stream_special_inside_a_character_is_skipped():
    tok = ByteTokenizer()
    ids = [0xE2, 257, 0x82, 0xAC]  # EOS lands between the bytes of "€"
    assert "".join(stream(tok, ids)) == tok.decode(ids) == "€"


def test_byte_stream_flush_emits_incomplete_tail():
    tok = ByteTokenizer()
    pieces = stream(tok, [0x41, 0xE2, 0x82])
    assert pieces[:3] == ["A", "", ""]
    assert pieces[3] == "\ufffd"


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_round_trip_and_stream_agree(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert "".join(stream(tok, ids)) == text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=300)))
def test_byte_stream_matches_decode_on_arbitrary_ids(ids):
    tok = ByteTokenizer(vocab_size=301)
    assert "".join(stream(tok, ids)) == tok.decode(ids)


# --- tokenizer.json -------------------------------------------------------------------------


def write_bytelevel_tokenizer(directory: Path) -> None:
    """A byte-level BPE with one merge, built in place: no downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["he"] = len(vocab)  # 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("h", "e")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])  # 257, 258
    tok.save(str(directory / "tokenizer.json"))


@pytest.fixture
def hf_dir(tmp_path):
    write_bytelevel_tokenizer(tmp_path)
    return tmp_path


def test_hf_encode_decode_and_specials(hf_dir):
    tok = HFTokenizer(hf_dir, bos_id=257, eos_id=[258, 7], vocab_size=300)
    assert (tok.bos_id, tok.eos_id, tok.eos_ids) == (257, 258, (258, 7))
    ids = tok.encode("hello é")
    assert ids[0] == 256  # the merge was applied
    assert 257 not in ids  # no template specials added by encode
    assert tok.decode([257, *ids, 258]) == "hello é"


def test_hf_stream_holds_back_partial_character(hf_dir):
    tok = HFTokenizer(hf_dir, bos_id=257, eos_id=258)
    ids = tok.encode("hé!")
    assert len(ids) == 4  # h, two bytes of é, !
    pieces = stream(tok, ids + [258])
    assert pieces == ["h", "", "é", "!", "", ""]


def test_hf_stream_flush_releases_held_text(hf_dir):
    tok = HFTokenizer(hf_dir, bos_id=None, eos_id=None)
    ids = tok.encode("é")
    pieces = stream(tok, ids[:1])
    assert pieces == ["", "\ufffd"]


def test_hf_vocab_larger_than_model_is_rejected(hf_dir):
    with pytest.raises(ConfigError, match="vocab_size"):
        HFTokenizer(hf_dir, bos_id=None, eos_id=None, vocab_size=100)


def test_hf_malformed_file_is_config_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer.json"):
        HFTokenizer(tmp_path, bos_id=None, eos_id=None)


# --- load_tokenizer -------------------------------------------------------------------------


def test_load_prefers_tokenizer_json(hf_dir):
    tok = load_tokenizer(str(hf_dir), bos_id=257, eos_id=258, vocab_size=512)
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == 258


def test_load_falls_back_to_bytes(tmp_path):
    assert isinstance(load_tokenizer(str(tmp_path), 256, 257, 258), ByteTokenizer)
    assert isinstance(load_tokenizer(None, 256, 257, 1024), ByteTokenizer)


def test_load_small_vocab_without_tokenizer_json_fails(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer.json is needed"):
        load_tokenizer(str(tmp_path), None, None, vocab_size=100)


def test_text_with_a_lone_surrogate_is_refused_with_a_clear_error():
    from kvfold.errors import InvalidInputError
    from kvfold.tokenizer import ByteTokenizer
    with pytest.raises(InvalidInputError, match="lone surrogate U\\+D800 at character 1"):
        ByteTokenizer().encode("a\ud800b")

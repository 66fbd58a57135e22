
from cluster.engine.detokenizer import IncrementalDetokenizer
from tests.cluster.factories import word_tokenizer


def stream(detok, token_ids):
    pieces = []
    for t in token_ids:
        detok.add(t)
        pieces.append(detok.take_new_text())
    pieces.append(detok.take_new_text(final=True))
    return pieces


def test_stop_string_across_tokens_is_cut_and_never_sent():
    tok = word_tokenizer()
    detok = IncrementalDetokenizer(tok, [1], stop=["w5 w6"])
    pieces = stream(detok, [2, 3, 6, 7, 8])  # " w1 w2 w5 w6 w7"
    assert detok.stopped
    assert "".join(pieces) == " w1 w2 "
    assert detok.text == " w1 w2 "


def test_earliest_stop_string_wins():
    detok = IncrementalDetokenizer(word_tokenizer(), [1], stop=["w3", "w2"])
    stream(detok, [2, 3, 4])
    assert detok.text == " w1 "


def test_no_broken_utf8_in_any_delta(tokenizer):
    text = "héllo 你好 wörld 🎉 ok"
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, [1], skip_special_tokens=True)
    pieces = stream(detok, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)

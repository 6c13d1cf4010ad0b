"""Stop strings: the one watcher, and `lm sample`'s stream and `lm serve`'s stream holding back the
same text (a piece that may start a stop string shows only once it cannot)."""

import numpy as np
import pytest

from lm.data.tokenizer import ByteTokenizer
from lm.infer.generate import Generation
from lm.infer.sampling import SamplingParams
from lm.infer.serve.engine_backend import EngineStream
from lm.infer.stops import StopWatch, held_back
from lm.infer.text import complete_ids

TOK = ByteTokenizer()
STOP = ("<|end|>", "\n\n")


def test_held_back_keeps_what_may_start_a_stop_string():
    assert held_back("abc<|e", ("<|end|>",)) == 3 and held_back("abc", ("<|end|>",)) == 0
    assert held_back("xa", ("ab", "b")) == 1 and held_back("", ("ab",)) == 0


def test_watcher_holds_back_then_releases_or_cuts():
    w = StopWatch(TOK, STOP)
    assert w.add(TOK.encode("hi <|")) == "hi " and not w.hit  # "<|" may start "<|end|>"
    assert w.add(TOK.encode("x")) == "<|x" and not w.hit  # it cannot any more: released
    assert w.add(TOK.encode(" <|en")) == " " and not w.hit
    assert w.add(TOK.encode("d|> after")) == "" and w.hit  # the stop string and what follows: never shown
    assert w.rest() == ""
    half = StopWatch(TOK, ())
    assert half.add(TOK.encode("é")[:1]) == "" and half.add(TOK.encode("é")[1:]) == "é"  # whole characters only


def _pieces(text: str, sizes=(1, 3, 2, 5)):
    ids, out, i = TOK.encode(text), [], 0
    while i < len(ids):
        n = sizes[len(out) % len(sizes)]
        out.append(ids[i : i + n])
        i += n
    return out


def _sample_stream(pieces, stop):
    """What `lm sample --stop` streams (lm.infer.text, as the engine calls it back)."""

    def generator(encoded, on_tokens=None):
        ids = []
        for piece in pieces:
            ids += piece.tolist()
            if on_tokens[0](piece, np.zeros(len(piece), np.float32)):
                break
        return Generation([np.asarray(ids, np.int32)], [np.zeros(len(ids), np.float32)], ["length"])

    shown = []
    result = complete_ids(generator, TOK, [[1]], stop=stop, stream=shown.append)[0]
    return shown, result


def _serve_stream(pieces, stop):
    """What `lm serve` streams for the same tokens (lm.infer.serve.engine_backend)."""
    stream = EngineStream(TOK, [1], SamplingParams(), stop, (TOK.eos_id,))
    for piece in pieces:
        if stream._on_tokens(piece, np.zeros(len(piece), np.float32)):
            stream.request.finish = "stop"
            break
    else:
        stream.request.finish = "length"
    stream._on_done(stream.request)
    deltas = []
    while not stream.deltas.empty():
        deltas.append(stream.deltas.get().text)
    return [d for d in deltas if d]


@pytest.mark.parametrize(
    "text", ["Sure <|en", "Sure <|end|> more", "a\nb\n\nc", "<|<|end|>", "x <|e|> y", "naïve <|end"]
)
def test_sample_and_serve_stream_hold_back_the_same_text(text):
    pieces = _pieces(text)
    shown, result = _sample_stream(pieces, STOP)
    served = _serve_stream(pieces, STOP)
    assert shown == served  # piece by piece, the same text at the same moments
    assert "".join(shown) == result["text"] and not any(s in "".join(shown) for s in STOP)

"""Stop strings: the text is always what plain decoding of the kept tokens gives, however
many tokens a speculative round adds at once."""

from __future__ import annotations

import random

from specdec.engine.stop import Detokenizer


class Chars:
    """Token i is the i-th letter: decode joins them."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def feed(stops, tokens, sizes):
    d = Detokenizer(Chars(), tuple(stops))
    kept, i = [], 0
    for n in sizes:
        chunk = tokens[i: i + n]
        i += n
        keep = d.add(chunk)
        if keep is not None:
            return kept + chunk[:keep], d.text
        kept += chunk
        if i >= len(tokens):
            break
    return kept, d.text


def test_a_round_that_completes_two_stops_keeps_what_plain_decoding_keeps():
    a, b, c = 0, 1, 2
    assert feed(["abc", "b"], [a, b, c], [1, 1, 1]) == ([a, b], "a")  # plain decoding
    assert feed(["abc", "b"], [a, b, c], [3]) == ([a, b], "a")        # one round of three


def test_any_round_sizes_give_the_token_by_token_result():
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 14))]
        stops = ["".join(chr(97 + rng.randrange(4)) for _ in range(rng.randrange(1, 4)))
                 for _ in range(rng.randrange(1, 4))]
        sizes, left = [], len(tokens)
        while left > 0:
            sizes.append(rng.randrange(1, 6))
            left -= sizes[-1]
        assert feed(stops, tokens, sizes) == feed(stops, tokens, [1] * len(tokens)), \
            (stops, tokens, sizes)

"""The per-call spread of the cooperative launches (``kernels_triton.spread``): the shared memory
that caps CTAs per SM, and the widest cap that keeps all of a call's clusters resident."""

from kernels_triton.spread import Spread, capped_shared_bytes, choose

H200_SHARED_PER_SM, RESERVED, OPTIN = 233472, 1024, 232448


def test_capped_shared_bytes_fit_exactly_that_many_ctas():
    for ctas in range(1, 9):
        size = capped_shared_bytes(ctas, H200_SHARED_PER_SM, RESERVED, OPTIN)
        assert ctas * (size + RESERVED) <= H200_SHARED_PER_SM < (ctas + 1) * (size + RESERVED)
    assert capped_shared_bytes(1, H200_SHARED_PER_SM, RESERVED, OPTIN) == OPTIN  # one CTA: the opt-in bound


def test_a_call_takes_the_widest_spread_that_holds_its_clusters():
    spreads = (Spread(1, 18, 232448), Spread(2, 37, 115712), Spread(4, 90, 57344), Spread(5, 117, 45670),
               Spread(8, 193, 28160))
    assert choose(spreads, 1) == spreads[0]
    assert choose(spreads, 18) == spreads[0]
    assert choose(spreads, 19) == spreads[1]
    assert choose(spreads, 100) == spreads[3]
    assert choose(spreads, 193) == spreads[4]
    assert choose(spreads, 194) is None  # a second wave under every cap: the launch keeps its own shared memory
    assert choose((), 1) is None
    assert choose(tuple(reversed(spreads)), 50) == spreads[2]  # the order the caps come in does not matter

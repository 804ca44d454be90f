"""What the controller remembers between periods shapes only its estimate: here, the request mix."""

from __future__ import annotations

from typing import Any

from rayscale.config import load_catalog
from rayscale.controller.loop import Controller
from rayscale.core.estimate import estimate
from rayscale.core.signals import Freshness, ModelSignals, RequestMix

SHORT = RequestMix(prompt_mean=100, output_mean=32, prompt_p95=200)


def test_a_window_without_finished_requests_keeps_the_last_mix_not_the_default() -> None:
    cat = load_catalog().subset(["mistral-7b"], ["a10g"])
    none: Any = None
    ctl = Controller(cat, none, none, none)  # only the memory is exercised: no I/O happens here
    seen = ctl._with_history(ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 2.0, SHORT))
    blind = ctl._with_history(ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 2.0, None))
    assert seen.mix == SHORT and blind.mix == SHORT
    assert blind.rate_history == (2.0,)
    # The default mix (long outputs) would make one replica look several times smaller.
    d_last = estimate(cat, {"mistral-7b": blind})["mistral-7b"]
    d_default = estimate(cat, {"mistral-7b": ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 2.0, None)})["mistral-7b"]
    assert d_last.capacity["a10g"].rps > 2 * d_default.capacity["a10g"].rps
    # A model never seen finishing a request still gets the default (and says nothing was remembered).
    other = Controller(cat, none, none, none)._with_history(ModelSignals("mistral-7b", Freshness.FRESH, 1.0, 2.0))
    assert other.mix is None

"""The call chain of one ar_text request, from Omni.generate down to the paged model's forward
(docs/architecture.md shows it): it reaches the forward, no function appears twice, no file is re-entered once the
chain has left it (nothing calls back up), and it stays within a sanity bound of omni's frames (the forward's
included)."""

from __future__ import annotations

from omni_kernel import Omni
from omni_kernel.testing import assert_chain_goes_down, call_chain
from omni_qwen.paged.decoder import PagedDecoder

MAX_FRAMES = 12


def test_ar_text_reaches_the_forward_without_calling_back_up(host):
    omni = Omni("ar_text", host=host, ar_device="cpu")
    chain = call_chain(PagedDecoder, "forward", lambda: omni.generate("hi", max_tokens=2))
    assert_chain_goes_down(chain, MAX_FRAMES)
    assert chain[-1].name == "omni_qwen.paged.decoder.PagedDecoder.forward", chain

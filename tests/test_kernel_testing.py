"""The test helpers of omni_kernel.testing: `drain`, `wait_until` and the call chain's spy and check (no pytest
needed to import them)."""

import subprocess
import sys

import pytest

from omni_kernel import Omni
from omni_kernel.builtin.echo import IdentityRunner, KernelPlugin
from omni_kernel.events import RequestFinished, TokenDelta
from omni_kernel.plugins import PluginHost
from omni_kernel.testing import Frame, assert_chain_goes_down, call_chain, drain, wait_until


def echo() -> Omni:
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel")
    return Omni("echo", host=host)


def test_drain_returns_every_event_until_nothing_is_unfinished():
    omni = echo()
    rids = [omni.submit(omni.request(p)) for p in ("a b c", "d e")]
    seen = []
    events = drain(omni, on_step=seen.append)
    assert not omni.has_unfinished() and [e for step in seen for e in step] == events
    finished = {e.request_id: e.result.text for e in events if isinstance(e, RequestFinished)}
    assert finished == dict(zip(rids, ("a b c", "d e")))
    assert drain(omni) == []  # nothing in flight: no step at all


def test_drain_fails_past_its_limit_and_stops_at_until():
    omni = echo()
    omni.submit(omni.request("one two three four"))
    with pytest.raises(AssertionError, match="still unfinished after 2 steps"):
        drain(omni, limit=2)
    first = drain(omni, until=lambda: True)
    assert first == [] and omni.has_unfinished()
    deltas = [e for e in drain(omni) if isinstance(e, TokenDelta)]
    assert "".join(e.text for e in deltas) == " three four"


def test_wait_until_returns_the_value_or_says_what_it_waited_for():
    calls = []
    assert wait_until(lambda: calls.append(1) or len(calls) >= 3 and "ready", 5, "three calls") == "ready"
    with pytest.raises(AssertionError, match="waited 0.05s for the moon, in vain"):
        wait_until(lambda: False, 0.05, "the moon")


def test_call_chain_holds_omnis_frames_from_generate_to_the_call_and_puts_the_method_back():
    omni = echo()
    chain = call_chain(IdentityRunner, "run", lambda: omni.generate("a b"))
    assert chain[0].name == "omni_kernel.api.generate", chain
    assert chain[-1].name == "omni_kernel.builtin.echo.IdentityRunner.run", chain
    assert all(frame.module.startswith("omni_kernel.") for frame in chain), chain
    assert_chain_goes_down(chain, 12)
    assert "run" in vars(IdentityRunner) and call_chain(IdentityRunner, "run", lambda: None) == []
    assert IdentityRunner.run.__qualname__ == "IdentityRunner.run"  # the spy is gone
    with pytest.raises(AssertionError, match="not from omni_kernel.api.generate"):
        call_chain(IdentityRunner, "run", lambda: list(omni.run([omni.request("c")])))


def test_assert_chain_goes_down_names_a_function_twice_a_file_entered_again_and_too_many_frames():
    a, b, a2 = Frame("omni_x.a", "f", "a.py"), Frame("omni_x.b", "g", "b.py"), Frame("omni_x.a", "h", "a.py")
    assert_chain_goes_down([a, a2, b], 3)
    with pytest.raises(AssertionError, match="never reached"):
        assert_chain_goes_down([], 3)
    with pytest.raises(AssertionError, match="a function appears twice"):
        assert_chain_goes_down([a, b, a], 3)
    with pytest.raises(AssertionError, match=r"\['a.py'\] entered again once the chain had left it"):
        assert_chain_goes_down([a, b, a2], 3)
    with pytest.raises(AssertionError, match="3 frames, more than 2"):
        assert_chain_goes_down([a, a2, b], 2)


@pytest.mark.cli_subprocess
def test_the_helpers_import_without_pytest():
    code = ("import sys; sys.modules['pytest'] = None\n"
            "from omni_kernel.testing import drain, wait_until\n"
            "print(wait_until(lambda: 7, 1, 'seven'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "7", out.stderr

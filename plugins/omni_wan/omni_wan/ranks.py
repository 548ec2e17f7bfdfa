"""RankGroup: the ranks of a Wan stage whose denoise forwards run over `cfg x ulysses` devices (parallel.py).

Rank 0 is the stage itself, wherever its placement put it (this process, a worker process, a Ray actor): it
holds the scheduler and the runner, prepares, decodes and exports, and talks to the StageScheduler as any stage.
It starts the other ranks (rank_launch.py: fresh interpreters on its machine, or Ray actors in one placement
group where rank 0 is a Ray actor; one device each on CUDA), which load the same model and wait for work. Each
denoise step rank 0 broadcasts the batch: the states of requests the other ranks have not seen yet (a request's
DenoiseState, sent once when it first denoises), the batch's request ids and steps, and the requests that left.
Then every rank runs `denoise_batch` on the same states, so every rank's states stay equal (the same gathered
predictions, combined and stepped alike) and nothing comes back.

A rank that dies (or a collective that fails) fails the step's requests with one message naming the stage and
the rank, and the group restarts off the step: the other ranks are stopped, and new ones are started and joined
by a background thread, so the step returns at once. A denoise step meanwhile waits for the group, at most
`restart_wait_s` (the stage's `wan_rank_restart_wait`), then runs, or past that fails its requests as stage
unavailable; the requests still denoising are sent to the new ranks at their next step. Ranks other than 0 load
only the transformer (all they run). The ranks meet at a TCPStore that rank 0 hosts on a port
the OS assigns. A rank dies with rank 0's process (the kernel launcher's PR_SET_PDEATHSIG; Ray: with its owner,
rank 0's actor).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import attrs
import torch
import torch.distributed as dist

from omni_kernel.core.errors import EngineDead, ModelError, RequestError, StageUnavailable
from omni_kernel.core.ranks import RankLauncher

from .comm import Mesh, init_ranks, open_store
from .device import WanDevice
from .rank_launch import launcher

log = logging.getLogger("omni")

ENTRY = "omni_wan.ranks:rank_main"  # what the other ranks run (rank_launch.py starts them)
POLL_S = 0.2  # how often rank 0 looks at its ranks while they load and join
DEATH_VISIBLE_S = 2.0  # how long a failed collective waits to see which rank exited (it is usually at once)


class RankDied(RequestError):
    """A rank of a stage's group died (or a collective failed): the step's requests fail, the group restarts."""


class RankGroup:
    """Rank 0's side (see the module docstring). `start()` starts the other ranks and joins the group."""

    def __init__(self, node_id: str, model, path, device: WanDevice, cfg: int, ulysses: int,
                 resources: dict | None = None, restart_wait_s: float = 600.0, start_ranks: RankLauncher | None = None):
        self.node_id = node_id
        self.start_ranks = start_ranks  # the placement's rank launcher (None: processes of this machine)
        self.model = model
        self.path = path
        self.device = device
        self.cfg, self.ulysses, self.resources = cfg, ulysses, resources
        self.num_ranks = cfg * ulysses
        self.ranks = None  # the launcher of the other ranks (rank_launch.py)
        self.store = None  # the group's rendezvous store, hosted by rank 0
        self.sent: set[str] = set()  # request ids whose state the other ranks hold
        self.left: list[str] = []  # request ids that left since the last step
        self.num_restarts = 0
        self.restart_wait_s = restart_wait_s
        self.ready = threading.Event()  # clear while the group restarts in the background
        self.ready.set()
        self.restart_error: BaseException | None = None  # why the last restart failed: the group is gone

    def start(self) -> None:
        self._launch()
        self._join()
        self._install()

    def _launch(self) -> None:
        """Start the other ranks (they load, then join the group at the store this process hosts)."""
        self.ranks = launcher(self.start_ranks)
        self.store = open_store(self.ranks.address, 0, self.num_ranks)  # the port the OS gave it, told to the ranks
        spec = {"entry": ENTRY, "address": self.ranks.address, "port": self.store.port, "num_ranks": self.num_ranks,
                "cfg": self.cfg, "ulysses": self.ulysses, "path": str(self.path), "device": attrs.asdict(self.device),
                "threads": torch.get_num_threads(), "node_id": self.node_id}
        self.ranks.launch([{**spec, "rank": rank} for rank in range(1, self.num_ranks)])

    def _install(self) -> None:
        from .parallel import WanParallel

        WanParallel.install(self.model, Mesh.build(self.cfg, self.ulysses))
        self.sent = set()

    def _join(self) -> None:
        """Join the group as rank 0 once every rank has loaded the model (they load, then join); a rank that
        ends first fails the start in one line instead of leaving rank 0 waiting for the collective timeout."""
        outcome: list = []
        joined = threading.Event()

        def join() -> None:
            try:
                init_ranks(0, self.num_ranks, self.store, self.device.device)
            except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
                outcome.append(exc)
            joined.set()

        threading.Thread(target=join, name=f"omni-{self.node_id}-join", daemon=True).start()
        while not joined.wait(POLL_S):
            if gone := self.ranks.gone():
                self.stop()
                raise ModelError(f"stage {self.node_id!r}: {', '.join(gone)} exited before it joined its group of "
                                 f"{self.num_ranks} ranks (its log lines above say why)")
        if outcome:
            self.stop()
            raise outcome[0]

    def denoise(self, states: list, steps: list[int], request_ids: list[str], cfg_batched: bool) -> None:
        """One denoise step of the batch on every rank (rank 0's own share here)."""
        self._wait_ready()
        new = {rid: state for rid, state in zip(request_ids, states) if rid not in self.sent}
        message = [("step", new, request_ids, steps, self.left, cfg_batched)]
        try:
            dist.broadcast_object_list(message, src=0)
            self.left = []
            self.sent |= set(new)
            self.model.denoise_batch(states, steps, cfg_batched=cfg_batched)
        except Exception as exc:  # noqa: BLE001 - a rank died or a collective failed: restart the group
            raise self._restart(exc) from None

    def _wait_ready(self) -> None:
        """Wait for a group that restarts, `restart_wait_s` at most: StageUnavailable past that, EngineDead when
        its restart failed."""
        if not self.ready.wait(self.restart_wait_s):
            raise StageUnavailable(f"stage {self.node_id!r}: stage unavailable: its rank group is restarting (a rank "
                                   f"died) and was not back within {self.restart_wait_s:g}s (wan_rank_restart_wait)",
                                   self.restart_wait_s)
        if self.restart_error is not None:
            raise EngineDead(f"stage {self.node_id!r}: its rank group could not be restarted after a rank died: "
                             f"{' '.join(str(self.restart_error).split())}")

    def forget(self, request_id: str) -> None:
        """A request left the stage: the other ranks drop its state at the next step."""
        if request_id in self.sent:
            self.sent.discard(request_id)
            self.left.append(request_id)

    def _restart(self, exc: Exception) -> RankDied:
        dead = self._dead_ranks()
        what = ", ".join(dead) or f"a collective failed ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
        self.num_restarts += 1
        message = (f"stage {self.node_id!r}: {what} of its {self.num_ranks} ranks died; the step's requests "
                   f"failed and the group restarted ({self.num_restarts} restarts)")
        log.error("%s", message)
        self.stop()
        self.left = []
        self.sent = set()
        self.ready.clear()
        try:
            self._launch()  # starting the processes is quick; their model loads are not: joined in the background
        except Exception as exc:  # noqa: BLE001 - raised by the next denoise step (EngineDead)
            self._restart_failed(exc)
            return RankDied(message)
        threading.Thread(target=self._join_again, name=f"omni-{self.node_id}-restart", daemon=True).start()
        return RankDied(message)

    def _join_again(self) -> None:
        """The restart's wait, off the step: the new ranks loaded and joined; a failure is kept for the next step."""
        try:
            self._join()
            self._install()
        except BaseException as exc:  # noqa: BLE001 - raised by the next denoise step (EngineDead)
            self._restart_failed(exc)
            return
        self.ready.set()

    def _restart_failed(self, exc: BaseException) -> None:
        log.error("stage %r: its rank group could not be restarted: %s", self.node_id, exc)
        self.restart_error = exc
        self.ready.set()

    def _dead_ranks(self) -> list[str]:
        """The ranks that exited. A killed rank's sockets close as it dies, so the collective can fail a moment
        before its exit is visible to this process: wait for it that long (bounded) to name it."""
        deadline = time.monotonic() + DEATH_VISIBLE_S
        dead = self.ranks.gone()
        while not dead and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self.ranks.gone()
        return dead

    def stop(self) -> None:
        """Stop the other ranks and leave the group."""
        if self.ranks is not None:
            self.ranks.stop()
        if self.model.parallel is not None:
            self.model.parallel.uninstall(self.model)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None


def rank_main(spec: dict) -> None:
    """A rank other than 0: load the transformer, join the group, then run each step rank 0 broadcasts."""
    from pathlib import Path

    import omni_hf

    from .model import Wan22I2VPipeline
    from .parallel import WanParallel

    logging.basicConfig(format=f"omni[{spec['node_id']} rank {spec['rank']}]: %(message)s", level=logging.INFO)
    torch.set_num_threads(spec["threads"])
    device = WanDevice(**spec["device"])
    if device.device == "cuda":
        torch.cuda.set_device(spec["rank"] % torch.cuda.device_count())
    with omni_hf.quiet_hf_load(("transformers", "diffusers")):  # rank 0 checked the tensors and says it loads
        model = Wan22I2VPipeline.load_transformer(Path(spec["path"]), device)
    store = open_store(spec["address"], spec["port"], spec["num_ranks"])
    comm_device = init_ranks(spec["rank"], spec["num_ranks"], store, device.device)
    WanParallel.install(model, Mesh.build(spec["cfg"], spec["ulysses"]))
    states: dict = {}
    while True:
        message = [None]
        try:
            dist.broadcast_object_list(message, src=0, device=comm_device if device.device == "cuda" else None)
        except Exception:  # noqa: BLE001 - rank 0 left the group (stopped, restarting, or gone)
            os._exit(0)
        _, new, request_ids, steps, left, cfg_batched = message[0]
        for rid in left:
            states.pop(rid, None)
        states.update(new)
        model.denoise_batch([states[rid] for rid in request_ids], steps, cfg_batched=cfg_batched)
        if not states:
            model.forget_batch()

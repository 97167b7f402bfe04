"""A vLLM push that fails on one rank raises on every rank (two real gloo processes).

In TRL's server mode only the main process talks to the vLLM server; had it raised alone, the other ranks would wait
in their next collective until the job was killed. The failing push is a stand-in object (the real server's
refusals are tested in test_vllm_server.py); what runs for real is the ranks' protocol.
"""

import os
import socket
from types import SimpleNamespace

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tlt_trainers.trl.sync import RankGroup
from tlt_trainers.trl.trainer import TLTGRPOTrainer


class RefusingServer:
    def push(self, drafter):
        raise RuntimeError("the vLLM server at http://server:8000 cannot read /tmp/drafter")


def _rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        trainer = SimpleNamespace(_tlt_vllm_sync=RefusingServer() if rank == 0 else None, _tlt_ranks=RankGroup(),
                                  drafter=None, _tlt_vllm_pushes=0, _tlt_vllm_scheduler=None)  # server mode
        try:
            TLTGRPOTrainer._tlt_push_drafter(trainer)
            results[rank] = "returned"
        except RuntimeError as error:
            results[rank] = str(error)
        assert trainer._tlt_ranks.first_error(None) is None  # and the ranks stay in step afterwards
    finally:
        dist.destroy_process_group()


def test_a_push_that_fails_on_the_main_process_raises_on_every_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        processes = [ctx.Process(target=_rank, args=(rank, port, results)) for rank in range(2)]
        for p in processes:
            p.start()
        for p in processes:
            p.join(timeout=120)
        hung = [p for p in processes if p.is_alive()]
        for p in hung:
            p.kill()
        assert not hung, "a rank waited for the failed one"
        assert [p.exitcode for p in processes] == [0, 0]
        assert "cannot read /tmp/drafter" in results[0]
        assert results[1] == ("Loading the drafter into vLLM failed on rank 0: RuntimeError: the vLLM server at "
                              "http://server:8000 cannot read /tmp/drafter")


if __name__ == "__main__":
    pytest.main([__file__, "-q"])

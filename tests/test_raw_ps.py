"""benchmarks/baselines/raw_ps.py --parts: the floors call_cpu.py and cluster.py set shardps beside (the per-part
loop in Python, and in C with ``--native``) take the same step."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from baselines.native import NoCompiler, build  # noqa: E402
from baselines.raw_ps import Client  # noqa: E402


@pytest.mark.parametrize("native,py_step", [(False, False), (True, False), (True, True)],
                         ids=["python", "native", "native-py-step"])
def test_the_raw_parts_server_steps_every_part_once_all_workers_sent_it(native, py_step):
    """Two workers, two parts a server, two steps: each part's weights come back as w - 0.01/2 (g0 + g1) a step."""
    if native:
        try:
            build()  # a build that fails is this test's failure; only a machine without a compiler skips
        except NoCompiler as e:
            pytest.skip(f"{e}: the C reference of benchmarks/call_cpu.py and cluster.py only; the product "
                        "needs none")
    torch.manual_seed(0)
    models = [torch.nn.Linear(64, 8) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())  # (the servers take rank 0's weights either way)
    start = torch.cat([p.detach().reshape(-1).clone() for p in models[0].parameters()])
    server = subprocess.Popen([sys.executable, str(BENCH / "baselines" / "raw_ps.py"), "--host", "127.0.0.1",
                               "--world", "2", "--lo", "0", "--hi", str(start.numel()), "--steps", "2",
                               "--timeout", "30", "--parts", "2", *(["--native"] if native else []),
                               *(["--py-step"] if py_step else [])],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline() if server.stdout else ""
        assert line.startswith("READY "), line
        address = line.split()[1]
        clients: list[Client | None] = [None, None]

        def connect(rank: int) -> None:  # rank 0's initial weights are read before anyone's answer
            clients[rank] = Client(models[rank], [address], rank, 30.0, parts=2, window=1, native=native)

        threads = [threading.Thread(target=connect, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        expected = start.clone()
        failed: list[BaseException] = []

        def step(c: Client) -> None:
            try:
                c.step()
            except BaseException as e:  # noqa: BLE001 - asserted below
                failed.append(e)

        for _ in range(2):
            grads = [torch.randn(start.numel()), torch.randn(start.numel())]
            for c, g in zip(clients, grads):
                assert c is not None
                c.grad.copy_(g)
            steps = [threading.Thread(target=step, args=(c,)) for c in clients if c is not None]
            for t in steps:
                t.start()
            for t in steps:
                t.join(30)
            assert not failed and not any(t.is_alive() for t in steps), failed
            expected -= 0.01 / 2 * (grads[0] + grads[1])
        for c in clients:
            assert c is not None
            assert torch.allclose(c.flat, expected, atol=1e-6)
            c.close()
    finally:
        server.kill()
        server.communicate(timeout=30)
